"""Flotilla's Kubernetes operator, imported as flotilla.operator (see DESIGN.md, the package trap)."""
