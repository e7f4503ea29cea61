"""`flotilla operator bench`: the operator's scale benchmark on a simulated local cluster (scale.py)."""
