"""flotilla-bench: the benchmarks of the engine (flotilla.bench.engine), the gateway (flotilla.bench.gateway)
and the operator (flotilla.bench.operator), a distribution of their own so that no product distribution
carries benchmark code or its plotting dependencies (matplotlib). The product groups never import it: the
root CLI (flotilla.cli) attaches each `bench` subcommand from flotilla.bench.<part>.cli when it is installed.
"""
