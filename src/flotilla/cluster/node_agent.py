"""The node agent: Flotilla's stand-in for the kubelet in the local cluster.

It registers fake GPU nodes, keeps their leases and Ready condition fresh, and runs every pod bound to
them as local processes on the pod's own loopback address (127.x.y.z), reporting status like a kubelet.
Images are never pulled: a container's command must exist on this host.

Like a kubelet it gives containers the KUBERNETES_SERVICE_* variables (pointing at the real API server),
the pod's volumes (pod_volumes: emptyDir, hostPath, claims, configMap, secret, downwardAPI, projected,
including the ServiceAccount token) mounted at their mountPaths in a mount namespace of the container's
own (mount_ns), and runs init containers before the main ones (pod_runtime). Without mount namespaces
(not root, no `unshare`) containers run as before, without their mounts, after one warning.

Stopping the agent leaves the pods running; the next agent adopts their processes from the pid table (as a
restarted kubelet finds its containers under the container runtime) and stops those whose pods are gone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flotilla import timestamps
from flotilla.cluster import mount_ns
from flotilla.cluster.kubeclient import ApiError, KubeClient
from flotilla.cluster.node_ports import NodePortProxy, selects
from flotilla.cluster.pod_runtime import PodRuntime, process_names
from flotilla.cluster.pod_status import overwritten, pod_status, simulated_status
from flotilla.cluster.pod_volumes import PodVolumes
from flotilla.cluster.processes import ProcessTable
from flotilla.cluster.service_account import TokenSource, api_endpoint, service_account_name, service_env
from flotilla.cluster.volume_contents import Sources, VolumeError
from flotilla.contract import GPU_RESOURCE, GPU_TYPE_LABEL

HOST_IP = "127.0.0.1"
LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10
NODE_STATUS_SECONDS = 60


def log(message: str) -> None:
    print(f"{dt.datetime.now().strftime('%H:%M:%S.%f')[:-3]} {message}", flush=True)


def node_ip_prefix(index: int, base: int = 1) -> str:
    """Node i owns 127.a.b.0/24 with a >= base >= 1, so no pod ever gets 127.0.0.x.

    Clusters sharing a host take different bases so their pods never share an address."""
    return f"127.{base + index // 250}.{index % 250}"


class IpPool:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.used: set[str] = set()

    def take(self, preferred: str | None = None) -> str:
        if preferred and preferred.startswith(self.prefix + ".") and preferred not in self.used:
            self.used.add(preferred)
            return preferred
        for host in range(2, 255):
            ip = f"{self.prefix}.{host}"
            if ip not in self.used:
                self.used.add(ip)
                return ip
        raise RuntimeError(f"node pool {self.prefix}.0/24 has no free pod address")

    def release(self, ip: str) -> None:
        self.used.discard(ip)


class NodeAgent:
    def __init__(
        self,
        client: KubeClient,
        node_names: list[str],
        gpus: int,
        gpu_type: str,
        state_dir: Path,
        simulate: bool = False,
        backoff_base: float = 1.0,
        pod_ip_base: int = 1,
    ):
        self.client = client
        self.nodes = {name: IpPool(node_ip_prefix(i, pod_ip_base)) for i, name in enumerate(node_names)}
        self.gpus, self.gpu_type = gpus, gpu_type
        self.state_dir = state_dir
        self.simulate = simulate
        self.backoff_base = backoff_base
        self.pids = ProcessTable(state_dir / "pids")
        self.probe_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="probe")
        self.lock = threading.Lock()
        self.seen: dict[str, dict] = {}  # uid -> latest pod object from the watch
        self.runtimes: dict[str, PodRuntime] = {}
        self.simulated: dict[str, str] = {}  # uid -> pod IP, for --simulate
        self.sent: dict[str, dict] = {}  # uid -> last status written
        self.sent_over: dict[str, str | None] = {}  # uid -> resourceVersion our last write replaced
        # Pods stopped and deleted with grace 0 that a finalizer (another's) keeps in the API for now.
        self.let_go: set[str] = set()
        self.stopping = threading.Event()
        self.listed = threading.Event()  # the watch has listed the pods once
        self.orphans_stopped = False
        self.services = service_env(*api_endpoint(client.server))
        self.sandbox_python: str | None = None  # set by check_sandbox when mount namespaces work
        self.node_ports = NodePortProxy(HOST_IP, self._ready_pods, log)

    # -- nodes and leases -------------------------------------------------------------------------

    def _node_status(self) -> dict:
        capacity = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "250",
            "ephemeral-storage": "1Ti",
            GPU_RESOURCE: str(self.gpus),
        }
        now = timestamps.now()
        conditions = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "FlotillaAgentReady",
                "message": "node agent is running",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            },
        ] + [
            {
                "type": t,
                "status": "False",
                "reason": f"No{t}",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": HOST_IP},
            ],
            "nodeInfo": {
                "kubeletVersion": "flotilla-node-agent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "flotilla://local-process",
                "osImage": "local processes",
                "kernelVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    def register_nodes(self) -> None:
        for name in self.nodes:
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                GPU_TYPE_LABEL: self.gpu_type,
                "flotilla.dev/node-agent": "true",
            }
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "status": self._node_status(),
            }
            try:
                self.client.create("/api/v1/nodes", body)
                log(f"registered node {name} ({self.gpus}x nvidia.com/gpu, {GPU_TYPE_LABEL}={self.gpu_type})")
            except ApiError as exc:
                if exc.status != 409:
                    raise
                self.client.strategic_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}})
                log(f"node {name} exists; refreshed its labels")
            self.client.strategic_patch(f"/api/v1/nodes/{name}/status", {"status": self._node_status()})

    def renew_leases(self) -> None:
        for name in self.nodes:
            path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
            spec = {
                "holderIdentity": name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": timestamps.now(micro=True),
            }
            try:
                self.client.merge_patch(path, {"spec": spec})
            except ApiError as exc:
                if exc.status != 404:
                    raise
                node = self.client.get(f"/api/v1/nodes/{name}")
                owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
                self.client.create(
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                    {"metadata": {"name": name, "ownerReferences": [owner]}, "spec": spec},
                )

    def heartbeat_loop(self) -> None:
        last_status: float | None = None  # the first status at once, however long the machine has been up
        while not self.stopping.is_set():
            try:
                self.renew_leases()
                if last_status is None or time.monotonic() - last_status > NODE_STATUS_SECONDS:
                    for name in self.nodes:
                        self.client.strategic_patch(
                            f"/api/v1/nodes/{name}/status", {"status": self._node_status()}
                        )
                    last_status = time.monotonic()
            except Exception as exc:  # keep heartbeating through API hiccups
                log(f"heartbeat failed: {exc}")
            self.stopping.wait(LEASE_RENEW_SECONDS)

    # -- pods --------------------------------------------------------------------------------------

    def _mine(self, pod: dict) -> bool:
        return pod.get("spec", {}).get("nodeName") in self.nodes

    def watch_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.client.get("/api/v1/pods")
                with self.lock:
                    self.seen = {p["metadata"]["uid"]: p for p in listing["items"] if self._mine(p)}
                self.listed.set()
                version = listing["metadata"]["resourceVersion"]
                for event in self.client.watch("/api/v1/pods", version, timeout_seconds=240):
                    if self.stopping.is_set():
                        return
                    kind, pod = event["type"], event["object"]
                    if kind == "BOOKMARK":
                        continue
                    if kind == "ERROR":
                        break
                    if not self._mine(pod):
                        continue
                    with self.lock:
                        if kind == "DELETED":
                            self.seen.pop(pod["metadata"]["uid"], None)
                        else:
                            self.seen[pod["metadata"]["uid"]] = pod
            except Exception as exc:
                if not self.stopping.is_set():
                    log(f"pod watch restarting: {exc}")
                    self.stopping.wait(1.0)

    def _lookup(self, kind: str):
        def get(namespace: str, name: str) -> dict[str, str] | None:
            try:
                obj = self.client.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise
            if kind == "secrets":
                from flotilla.cluster.pod_env import secret_data

                return secret_data(obj)
            return dict(obj.get("data") or {})

        return get

    def _object(self, kind: str):
        """(namespace, name) -> the raw object, None when absent: what volume projections read."""

        def get(namespace: str, name: str) -> dict | None:
            try:
                return self.client.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise

        return get

    def _claim_path(self, namespace: str, claim_name: str) -> str:
        """A claim's folder: the hostPath or local path of the PersistentVolume it is bound to."""
        claim = self._object("persistentvolumeclaims")(namespace, claim_name)
        if claim is None:
            raise VolumeError(f"persistentvolumeclaim {namespace}/{claim_name} not found")
        volume_name = (claim.get("spec") or {}).get("volumeName")
        if not volume_name or (claim.get("status") or {}).get("phase") != "Bound":
            raise VolumeError(f"persistentvolumeclaim {namespace}/{claim_name} is not bound")
        spec = self.client.get(f"/api/v1/persistentvolumes/{volume_name}").get("spec") or {}
        path = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        if not path:
            raise VolumeError(
                f"persistentvolume {volume_name}: only hostPath and local volumes can be mounted"
            )
        return path

    def _volumes(self, pod: dict, ip: str) -> PodVolumes:
        meta = pod["metadata"]
        tokens = TokenSource(pod, self.client.create)
        sources = Sources(self._object("configmaps"), self._object("secrets"), tokens.token, ip, HOST_IP)
        root = self.state_dir / "volumes" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"

        def account() -> dict | None:
            return self._object("serviceaccounts")(meta["namespace"], service_account_name(pod))

        return PodVolumes(pod, root, sources, account, self._claim_path)

    def check_sandbox(self) -> None:
        """Once per agent: can containers get their own mount namespaces? If not, warn and go on."""
        ok, why = mount_ns.available(sys.executable)
        if ok:
            self.sandbox_python = sys.executable
            log("containers get their own mount namespaces: volumes are mounted at their mountPaths")
        else:
            log(f"WARNING: no mount namespaces for containers ({why}); pods run without their volume mounts")

    def _pod_path(self, pod: dict) -> str:
        meta = pod["metadata"]
        return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"

    def _write_status(self, uid: str, pod: dict, status: dict) -> None:
        version = pod["metadata"].get("resourceVersion")
        if self.sent.get(uid) == status and (
            version == self.sent_over.get(uid)  # the watch has not delivered our write yet
            or not overwritten(pod.get("status") or {}, status)
        ):
            return
        try:
            self.client.strategic_patch(self._pod_path(pod) + "/status", {"status": status})
            self.sent[uid] = status
            self.sent_over[uid] = version
        except ApiError as exc:
            if exc.status != 404:
                log(f"status of {pod['metadata']['namespace']}/{pod['metadata']['name']}: {exc}")

    def _finish_deletion(self, uid: str, pod: dict) -> None:
        if uid in self.let_go:
            return
        try:
            self.client.delete(self._pod_path(pod), {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
        except ApiError as exc:
            if exc.status not in (404, 409):
                log(f"deleting {pod['metadata']['name']}: {exc}")
                return
        log(f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} stopped and removed")
        self._forget(uid, pod)
        self.let_go.add(uid)

    def _forget(self, uid: str, pod: dict) -> None:
        runtime = self.runtimes.pop(uid, None)
        if runtime is not None and runtime.volumes is not None:
            runtime.volumes.cleanup()
        ip = runtime.pod_ip if runtime else self.simulated.pop(uid, None)
        if ip:
            self.nodes[pod["spec"]["nodeName"]].release(ip)
        self.sent.pop(uid, None)
        self.sent_over.pop(uid, None)

    def sync_once(self) -> None:
        now = time.monotonic()
        listed = self.listed.is_set()  # before the copy: `seen` then holds the whole first listing
        with self.lock:
            seen = dict(self.seen)
        # Pods that already have an address first: a restarted agent hands each adopted pod its own IP
        # back before a pod made while it was down can take that IP (its status would then be refused).
        for uid, pod in sorted(seen.items(), key=lambda item: not (item[1].get("status") or {}).get("podIP")):
            meta, spec = pod["metadata"], pod["spec"]
            deleting = meta.get("deletionTimestamp") is not None
            pool = self.nodes[spec["nodeName"]]
            if self.simulate:
                if deleting:
                    self._finish_deletion(uid, pod)
                    continue
                if uid not in self.simulated:
                    self.simulated[uid] = pool.take((pod.get("status") or {}).get("podIP"))
                start = (pod.get("status") or {}).get("startTime") or timestamps.now()
                self._write_status(uid, pod, simulated_status(pod, self.simulated[uid], HOST_IP, start))
                continue
            runtime = self.runtimes.get(uid)
            if runtime is None:
                # Processes a previous agent left for this pod are adopted below, even when the pod is
                # being deleted: they must be stopped within its grace period and their end reported.
                left = any(self.pids.get(name) for name in process_names(pod))
                if deleting and not left:
                    self._finish_deletion(uid, pod)
                    continue
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and not left:
                    continue
                ip = pool.take((pod.get("status") or {}).get("podIP"))
                runtime = PodRuntime(
                    pod,
                    ip,
                    HOST_IP,
                    self.state_dir / "logs" / f"{meta['namespace']}_{meta['name']}",
                    self.pids,
                    (self._lookup("configmaps"), self._lookup("secrets")),
                    self.probe_pool,
                    backoff_base=self.backoff_base,
                    volumes=self._volumes(pod, ip),
                    sandbox_python=self.sandbox_python,
                    services=self.services,
                )
                self.runtimes[uid] = runtime
                adopted = runtime.adopt(now)
                taken = f" (adopted running containers: {', '.join(adopted)})" if adopted else ""
                log(f"pod {meta['namespace']}/{meta['name']} on {spec['nodeName']} at {ip}{taken}")
            runtime.pod = pod
            if deleting:
                grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
                runtime.begin_termination(float(grace), now)
                if runtime.termination_done(now):
                    runtime.record_exits(now)
                    self._write_status(uid, pod, pod_status(runtime))
                    self._finish_deletion(uid, pod)
                continue
            runtime.sync(now)
            for problem in runtime.refresh_problems:
                log(f"pod {meta['namespace']}/{meta['name']}: {problem}")
            runtime.refresh_problems.clear()
            self._write_status(uid, pod, pod_status(runtime))
        for uid in set(self.runtimes) - set(seen):
            runtime = self.runtimes[uid]
            runtime.kill_now()
            self._forget(uid, runtime.pod)
        for uid in set(self.simulated) - set(seen):
            self.simulated.pop(uid, None)
        self.let_go &= set(seen)
        if not self.orphans_stopped and listed:
            self._stop_orphans()

    def _stop_orphans(self) -> None:
        """Once the first pod listing has been handled: processes a previous agent left for pods that are
        no longer in the API (deleted while no agent ran) are stopped; every other one was adopted."""
        self.orphans_stopped = True
        claimed = {name for runtime in self.runtimes.values() for name in process_names(runtime.pod)}
        orphans = [name for name in self.pids.names() if name not in claimed]
        for name in orphans:
            if self.pids.stop(name, grace_seconds=5.0):
                log(f"stopped pod process {name}: its pod is gone from the API")

    def _ready_pods(self, namespace: str, selector: dict[str, str]) -> list[tuple[dict, str]]:
        """The pods a NodePort forwards to: Ready, not terminating, selected by the Service."""
        out = []
        for runtime in list(self.runtimes.values()):
            pod = runtime.pod
            if (
                pod["metadata"]["namespace"] == namespace
                and selects(selector, pod)
                and runtime.terminating_deadline is None
                and not pod["metadata"].get("deletionTimestamp")
                and runtime.containers
                and all(run.ready for run in runtime.containers)
            ):
                out.append((pod, runtime.pod_ip))
        return out

    def services_loop(self) -> None:
        """Follows the Services' node ports (kube-proxy's job for NodePort Services, in user space)."""
        while not self.stopping.is_set():
            try:
                self.node_ports.sync(self.client.get("/api/v1/services").get("items", []))
            except Exception as exc:
                log(f"services: {exc!r}")
            self.stopping.wait(1.0)

    def run(self) -> None:
        if not self.simulate:
            self.check_sandbox()
        self.register_nodes()
        self.renew_leases()
        threads = [
            threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self.watch_loop, name="pod-watch", daemon=True),
        ]
        if not self.simulate:
            threads.append(threading.Thread(target=self.services_loop, name="node-ports", daemon=True))
        for thread in threads:
            thread.start()
        log(f"node agent running: {len(self.nodes)} nodes{' (simulated pods)' if self.simulate else ''}")
        while not self.stopping.is_set():
            try:
                self.sync_once()
            except Exception as exc:
                log(f"sync failed: {exc!r}")
            self.stopping.wait(0.25)
        self.shutdown()

    def shutdown(self) -> None:
        """Stops the agent and leaves the pods running, as a kubelet leaves its containers to the runtime:
        the next agent adopts them. `flotilla cluster down` stops the pods after the agent."""
        log(f"node agent stopping; {len(self.runtimes)} pods keep running for the next agent to adopt")
        self.node_ports.close()
        self.probe_pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flotilla-node-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-type", default="h100")
    parser.add_argument("--node-prefix", default="gpu-node")
    parser.add_argument(
        "--simulate", action="store_true", help="mark pods Running and Ready without processes"
    )
    parser.add_argument("--pod-ip-base", type=int, default=1, help="pods get 127.BASE.x.y and up")
    parser.add_argument(
        "--restart-backoff", type=float, default=1.0, help="first restart back-off in seconds"
    )
    args = parser.parse_args(argv)
    names = [f"{args.node_prefix}-{i}" for i in range(args.nodes)]
    agent = NodeAgent(
        KubeClient(args.kubeconfig),
        names,
        args.gpus,
        args.gpu_type,
        args.state_dir,
        simulate=args.simulate,
        backoff_base=args.restart_backoff,
        pod_ip_base=args.pod_ip_base,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stopping.set())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
