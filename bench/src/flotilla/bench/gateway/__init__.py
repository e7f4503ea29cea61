"""`flotilla gateway bench routing|overhead`: the gateway measured against real engines and a stub.

Everything runs as subprocesses of the benchmark (engines, the gateway, the stub upstream), started with
`sys.executable -m flotilla.cli ...`, so this package imports neither the engine nor the operator:

- `figures`  pure: percentiles, exposition parsing, the JSON summaries (unit-tested, no I/O)
- `workload` pure: the shared-prefix multi-turn chat workload of `routing`
- `procs`    starting, health-waiting and stopping the subprocesses; free ports; CPU pinning
- `rawhttp`  a minimal keep-alive HTTP/1.1 client (the overhead runs: cheaper than httpx per request)
- `stub`     an upstream that answers at once (`python -m flotilla.bench.gateway.stub`)
- `routing`, `overhead`  the two benchmarks; `cli` their flags (argparse only: import-light)
"""
