"""Envoy's graceful stop in the chart's gateway pod: `flotilla gateway envoy-drain`, the gateway container's
preStop hook. It asks Envoy's admin (its unix socket in the pod's volume) to drain its listeners gracefully
(every response from then on closes its connection, and Envoy stops listening once its drain time is over),
then waits until none of the clients' requests is in flight, at least `settle` seconds (while the Service's
endpoints drop the terminating pod, a request may still arrive) and at most `timeout`.

The gateway container, and the picker in it, is only signalled once this returns, so the picker keeps
answering the streams Envoy still carries; Envoy, the pod's sidecar, is signalled after the gateway
container has stopped (Kubernetes stops sidecars last). Nothing here sleeps for a fixed time beyond
`settle`: a pod with no request in flight stops after it.
"""

from __future__ import annotations

import re
import sys
import time

import httpx

from flotilla.gateway.proxy.bootstrap import LISTENER_STAT_PREFIX

ACTIVE_STAT = f"http.{LISTENER_STAT_PREFIX}.downstream_rq_active"  # the clients' requests in flight
_ACTIVE = re.compile(rf"^{re.escape(ACTIVE_STAT)}: (\d+)$", re.MULTILINE)


def admin_client(admin_pipe: str) -> httpx.Client:
    """Envoy's admin, over its unix socket."""
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=admin_pipe), base_url="http://envoy", timeout=5, trust_env=False
    )


def active_requests(client: httpx.Client) -> int:
    text = client.get("/stats", params={"filter": f"^{re.escape(ACTIVE_STAT)}$"}).text
    found = _ACTIVE.search(text)
    if found is None:
        raise RuntimeError(f"Envoy's admin has no {ACTIVE_STAT}: {text[:200]!r}")
    return int(found.group(1))


def drain(admin_pipe: str, timeout: float, settle: float = 5.0, poll: float = 0.5) -> int:
    """Starts the drain and waits as above; returns the requests still in flight (0: all finished)."""
    start = time.monotonic()
    try:
        with admin_client(admin_pipe) as client:
            client.post("/drain_listeners", params={"graceful": ""}).raise_for_status()
            print(
                f"envoy-drain: draining Envoy's listeners (admin {admin_pipe})", file=sys.stderr, flush=True
            )
            while True:
                active = active_requests(client)
                elapsed = time.monotonic() - start
                if (active == 0 and elapsed >= settle) or elapsed >= timeout:
                    print(f"envoy-drain: {active} request(s) in flight after {elapsed:.1f}s", file=sys.stderr,
                          flush=True)  # fmt: skip
                    return active
                time.sleep(poll)
    except httpx.TransportError as exc:  # Envoy already gone: nothing left to wait for
        print(f"envoy-drain: Envoy's admin is not answering ({exc}); nothing to drain", file=sys.stderr)
        return 0
