"""NodePort forwarding: which ports, which pods, and real bytes through a real listener on loopback."""

from __future__ import annotations

import socket
import threading

from flotilla.cluster.handle import free_port, wait_for
from flotilla.cluster.node_ports import NodePort, NodePortProxy, node_ports, selects, target_port


def _service(
    name: str, type_: str = "NodePort", node_port: int | None = 31000, target="webhook", selector=None
):
    port = {
        "port": 443,
        "targetPort": target,
        "protocol": "TCP",
        **({"nodePort": node_port} if node_port else {}),
    }
    spec = {"type": type_, "ports": [port], "selector": {"app": "op"} if selector is None else selector}
    return {"metadata": {"namespace": "sys", "name": name}, "spec": spec}


def _pod(labels: dict, ports: list[dict]) -> dict:
    return {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "ports": ports}]}}


def test_only_node_ports_with_a_selector_are_forwarded():
    services = [
        _service("a"),
        _service("cluster-ip", type_="ClusterIP", node_port=None),
        _service("no-selector", selector={}),
        _service("lb", type_="LoadBalancer", node_port=31001, target=9443),
    ]
    assert node_ports(services) == [
        NodePort("sys", "a", 31000, "webhook", (("app", "op"),)),
        NodePort("sys", "lb", 31001, 9443, (("app", "op"),)),
    ]


def test_selector_and_named_target_port():
    pod = _pod({"app": "op", "tier": "x"}, [{"name": "webhook", "containerPort": 9443}])
    assert selects({"app": "op"}, pod) and not selects({"app": "other"}, pod)
    assert target_port(pod, "webhook") == 9443
    assert target_port(pod, 8080) == 8080 and target_port(pod, "8080") == 8080
    assert target_port(pod, "missing") is None


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_connections_reach_a_ready_pod_and_are_refused_without_one():
    server, upstream_port = _echo_server()
    ready: list[tuple[dict, str]] = []
    proxy = NodePortProxy("127.0.0.1", lambda namespace, selector: list(ready), log=lambda _: None)
    node_port = free_port()
    try:
        proxy.sync([_service("a", node_port=node_port)])
        assert node_port in proxy.listeners
        # No Ready pod: the connection is accepted and closed at once, like a Service without endpoints.
        with socket.create_connection(("127.0.0.1", node_port), timeout=10) as conn:
            assert conn.recv(10) == b""
        ready.append(
            (_pod({"app": "op"}, [{"name": "webhook", "containerPort": upstream_port}]), "127.0.0.1")
        )
        with socket.create_connection(("127.0.0.1", node_port), timeout=10) as conn:
            conn.sendall(b"hello")
            assert wait_for(lambda: conn.recv(10), 10, "the echo") == b"HELLO"
        # The Service goes away: so does the listener.
        proxy.sync([])
        assert not proxy.listeners
    finally:
        proxy.close()
        server.close()


def test_a_released_node_port_is_taken_again_at_once():
    """A chart reinstall deletes the Service and makes it again with the same nodePort: the listener must
    bind at the first sync after, not after a connection happens to wake the old accept thread."""
    proxy = NodePortProxy("127.0.0.1", lambda namespace, selector: [], log=lambda _: None)
    node_port = free_port()
    try:
        for round_ in range(3):
            proxy.sync([_service(f"webhook-{round_}", node_port=node_port)])
            assert node_port in proxy.listeners, f"round {round_}: nodePort {node_port} not bound"
            wait_for(lambda: _blocked_in_accept(f"nodeport-{node_port}"), 10, "the accept thread to block")
            proxy.sync([])
            assert not proxy.listeners
    finally:
        proxy.close()


def _blocked_in_accept(thread_name: str) -> bool:
    """Whether the thread is asleep in accept(2) (the kernel's wait channel), the state a release must end."""
    for thread in threading.enumerate():
        if thread.name == thread_name and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/wchan") as wchan:
                    return "accept" in wchan.read()
            except OSError:
                return False
    return False
