"""The local cluster: real control-plane binaries built from Go modules, plus the node agent."""
