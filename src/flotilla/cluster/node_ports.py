"""NodePort Services on the local cluster: what kube-proxy does, in user space, for the node agent's pods.

The local cluster has no kube-proxy and no cluster network: pods listen on their own loopback address
(127.a.b.c), and EndpointSlices refuse loopback addresses, so a ClusterIP leads nowhere. A NodePort does:
for every Service of type NodePort (or LoadBalancer) the agent listens on the node's address at the
port's `nodePort` and forwards each TCP connection to a Ready pod that the Service selects (round robin),
at the port's `targetPort`. The API server then reaches an in-cluster admission webhook at
`https://127.0.0.1:<nodePort>`, and a rolling update of the pods behind it never drops the address.

Connections are forwarded as bytes (TLS passes through). Endpoint choice is pure (`ready_endpoints`,
`target_port`) and unit-tested; the listeners are plain threads.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

# (namespace, selector) -> the selected pods that are Ready, as (pod object, pod IP).
ReadyPods = Callable[[str, dict[str, str]], list[tuple[dict, str]]]

BUFFER = 64 * 1024


@dataclass(frozen=True)
class NodePort:
    namespace: str
    service: str
    node_port: int
    target_port: int | str  # a number, or the name of a container port
    selector: tuple[tuple[str, str], ...]


def node_ports(services: list[dict]) -> list[NodePort]:
    """Every node port the Services ask for (a Service without a selector has no pods to forward to)."""
    out = []
    for svc in services:
        spec, meta = svc.get("spec") or {}, svc.get("metadata") or {}
        selector = spec.get("selector") or {}
        if spec.get("type") not in ("NodePort", "LoadBalancer") or not selector:
            continue
        for port in spec.get("ports") or []:
            if port.get("nodePort") and (port.get("protocol") or "TCP") == "TCP":
                out.append(
                    NodePort(
                        meta.get("namespace", "default"),
                        meta.get("name", ""),
                        int(port["nodePort"]),
                        port.get("targetPort") or port["port"],
                        tuple(sorted(selector.items())),
                    )
                )
    return out


def selects(selector: dict[str, str], pod: dict) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def target_port(pod: dict, target: int | str) -> int | None:
    """The pod's port for a Service's targetPort: the number itself, or the container port of that name."""
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


class NodePortProxy:
    """Listens on `host` at each node port and forwards to Ready pods; `sync` follows the Services."""

    def __init__(self, host: str, ready_pods: ReadyPods, log: Callable[[str], None] = print):
        self.host, self.ready_pods, self.log = host, ready_pods, log
        self.listeners: dict[int, tuple[NodePort, socket.socket]] = {}
        self.turn = itertools.count()
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def sync(self, services: list[dict]) -> None:
        wanted = {port.node_port: port for port in node_ports(services)}
        with self.lock:
            for number in list(self.listeners):
                if number not in wanted or wanted[number] != self.listeners[number][0]:
                    _release(self.listeners.pop(number)[1])
            for number, port in wanted.items():
                if number not in self.listeners:
                    self._listen(port)

    def _listen(self, port: NodePort) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, port.node_port))
        except OSError as exc:
            sock.close()
            self.log(f"nodePort {port.node_port} of service {port.namespace}/{port.service}: {exc}")
            return
        sock.listen(64)
        self.listeners[port.node_port] = (port, sock)
        threading.Thread(
            target=self._accept, args=(port, sock), name=f"nodeport-{port.node_port}", daemon=True
        ).start()
        self.log(f"nodePort {self.host}:{port.node_port} -> service {port.namespace}/{port.service}")

    def _accept(self, port: NodePort, sock: socket.socket) -> None:
        while not self.closed.is_set():
            try:
                client, _ = sock.accept()
            except OSError:
                return  # closed by sync or shutdown
            threading.Thread(target=self._forward, args=(port, client), daemon=True).start()

    def _upstream(self, port: NodePort) -> socket.socket | None:
        pods = self.ready_pods(port.namespace, dict(port.selector))
        if not pods:
            return None
        start = next(self.turn)
        for offset in range(len(pods)):  # a pod that refuses is skipped, as a dead endpoint would be
            pod, ip = pods[(start + offset) % len(pods)]
            number = target_port(pod, port.target_port)
            if number is None:
                continue
            try:
                return socket.create_connection((ip, number), timeout=5)
            except OSError:
                continue
        return None

    def _forward(self, port: NodePort, client: socket.socket) -> None:
        upstream = self._upstream(port)
        if upstream is None:
            client.close()  # no Ready endpoint: refused, as kube-proxy rejects a Service without endpoints
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            for _, sock in self.listeners.values():
                _release(sock)
            self.listeners.clear()


def _release(sock: socket.socket) -> None:
    """Frees the port at once. close() alone does not: the accept thread blocked in accept(2) keeps the
    kernel's socket, still bound, until a connection arrives, so a Service recreated with the same
    nodePort (a chart reinstall) could not bind it (EADDRINUSE). shutdown(2) wakes that accept first."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copies one direction until its end, then passes the end on (a half close), as TCP would."""
    try:
        while data := source.recv(BUFFER):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
