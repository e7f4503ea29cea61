"""Flotilla's Kubernetes operator, imported as `flotilla.operator`.

Its modules live here, in operator/src/, not in operator/ itself: a regular package folder named
`operator` at the repository root would shadow the standard library's `operator` module for any
`python -m ...` run from the root (see DESIGN.md, "The package trap").
"""
