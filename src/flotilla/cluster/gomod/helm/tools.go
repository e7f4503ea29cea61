//go:build tools

// Package tools pins Helm's CLI so that `go mod tidy` keeps its dependencies.
package tools

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
