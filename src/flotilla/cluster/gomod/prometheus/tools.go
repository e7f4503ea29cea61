//go:build tools

// Package tools pins Prometheus's server and promtool so that `go mod tidy` keeps their dependencies.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
