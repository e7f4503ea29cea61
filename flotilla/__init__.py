"""Flotilla: LLM inference fleets on Kubernetes."""

__version__ = "0.1.0"
