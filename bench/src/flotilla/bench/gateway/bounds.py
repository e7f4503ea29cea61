"""`flotilla gateway bench overhead --bounds`: the floor under any endpoint picker. Beside the relay and
Envoy + Flotilla's picker, in front of the stub, three more data planes on the same pinned CPU:

- `envoy-alone`: Envoy on the same bootstrap less its ext_proc filter (what Envoy itself costs);
- `null-picker`: Envoy + the null picker (nullpicker/main.go, Go), which answers each ext_proc exchange at
  once with a fixed destination: what Envoy and the four exchanges cost when the picker costs nothing;
- `null-picker-request-phases`: the same with the response phases skipped (two exchanges a request).

A compiled picker that applied Flotilla's rules could only be slower than the null one, so its figures
bound what any picker, in any language, reaches on this machine. The null picker is built with `go build`
into the output folder (the Go toolchain and its module proxy are needed; nothing else is).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

from flotilla.bench.gateway.figures import BOUND_PLANES, ENVOY_ALONE, NULL_PICKER_REQUEST_PHASES
from flotilla.bench.gateway.procs import HOST, Proc, StartupError, progress
from flotilla.gateway.proxy.bootstrap import ENGINES_CLUSTER, EXT_PROC_FILTER

NULL_PICKER_SOURCE = Path(__file__).with_name("nullpicker")


def bound_config(config: dict[str, Any], plane: str, upstream_port: int) -> dict[str, Any]:
    """The bootstrap (`flotilla gateway envoy-config`'s JSON) for one bound plane: the engines' cluster is
    static on the upstream (no EDS: the null picker serves none), and `plane` decides the ext_proc filter
    (removed, kept, or kept without the response phases)."""
    if plane not in BOUND_PLANES:
        raise ValueError(f"plane must be one of {', '.join(BOUND_PLANES)}, not {plane!r}")
    config = copy.deepcopy(config)
    engines = next(c for c in config["static_resources"]["clusters"] if c["name"] == ENGINES_CLUSTER)
    engines["type"] = "STATIC"
    engines.pop("eds_cluster_config")
    address = {"socket_address": {"address": HOST, "port_value": upstream_port}}
    engines["load_assignment"] = {
        "cluster_name": ENGINES_CLUSTER,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    }
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                filters = network_filter.get("typed_config", {}).get("http_filters")
                if filters is None:
                    continue
                if plane == ENVOY_ALONE:
                    filters[:] = [f for f in filters if f["name"] != EXT_PROC_FILTER]
                elif plane == NULL_PICKER_REQUEST_PHASES:
                    for f in filters:
                        if f["name"] == EXT_PROC_FILTER:
                            f["typed_config"]["processing_mode"].update(
                                response_header_mode="SKIP", response_body_mode="NONE"
                            )
    return config


def build_null_picker(out: Path) -> Path:
    """`go build` of nullpicker/ into `out` (its module downloads on first use)."""
    go = shutil.which("go")
    if go is None:
        raise StartupError("--bounds needs the Go toolchain (`go` on PATH) to build the null picker")
    binary = out / "nullpicker"
    progress(f"building the null picker from {NULL_PICKER_SOURCE} (go build; modules download on first use)")
    built = subprocess.run([go, "build", "-o", str(binary), "."], cwd=NULL_PICKER_SOURCE, capture_output=True,
                           text=True)  # fmt: skip
    if built.returncode != 0:
        raise StartupError(
            f"go build of the null picker failed (code {built.returncode}): {built.stderr[-800:]}"
        )
    return binary


def null_picker_proc(binary: Path, port: int, destination_port: int, log: Path, cpus: list[int]) -> Proc:
    """The null picker on `port`, every request to the upstream on `destination_port`, not yet started (it
    serves gRPC only: ready once it listens)."""
    argv = [str(binary), "-listen", f"{HOST}:{port}", "-destination", f"{HOST}:{destination_port}"]
    return Proc("null-picker", argv, port, log, cpus=cpus, listens_only=True)
