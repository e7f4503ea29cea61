//go:build tools

// Package tools pins the control-plane and node packages so that `go mod tidy` keeps their dependencies.
// The binaries themselves are built with `go build k8s.io/kubernetes/cmd/<name>`.
package tools

import (
	_ "k8s.io/kubectl/pkg/cmd"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-proxy/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
