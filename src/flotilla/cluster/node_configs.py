"""The configuration files of a kubelet node: containerd's, the CNI network's, the kubelet's and kube-proxy's.

Pure text from a NodeLayout; node_host writes them and node_machine starts the components with them.
Why each setting differs from its default on this project's machines is said beside it
(../shared/FIELD-NOTES.md has the sources)."""

from __future__ import annotations

import json
from pathlib import Path

from flotilla.cluster.node_layout import CNI_BIN_DIR, PAUSE_IMAGE, NodeLayout, cluster_cidr

RUNC = "/usr/sbin/runc"
KUBELET_PORT = 10250


def containerd_toml(layout: NodeLayout) -> str:
    # restrict_oom_score_adj: runc cannot lower its oom_score_adj here, and without it every start fails.
    # SystemdCgroup false: no systemd on these machines; the kubelet uses cgroupfs too.
    del layout  # the same for every node: its folders are the standard paths inside its mount namespace
    return f"""version = 2
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "/etc/cni/net.d"
"""


def cni_conflist(layout: NodeLayout) -> str:
    """A bridge per node with its pod range; the node routes everything else to the host's bridge."""
    network = {
        "cniVersion": "1.0.0",
        "name": "flotilla",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": layout.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(network, indent=2) + "\n"


def kubelet_config(layout: NodeLayout, pki_dir: Path) -> str:
    pki = pki_dir.resolve()
    serving = f"kubelet-serving-{layout.name}"
    # failCgroupV1 false: these machines mount cgroup v1 controllers (a hybrid host).
    # cgroupRoot: each node's pods under a root of their own, so nodes and clusters on one host never share.
    # imageGC at 100%: images come from `ctr import`, not a registry; a collected image could not return.
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {layout.ip}
port: {KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {pki / "ca.crt"}}}
authorization: {{mode: Webhook}}
tlsCertFile: {pki / (serving + ".crt")}
tlsPrivateKeyFile: {pki / (serving + ".key")}
cgroupDriver: cgroupfs
cgroupRoot: {layout.cgroup_root}
cgroupsPerQOS: true
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{layout.containerd_socket}
podCIDR: {layout.pod_cidr}
resolvConf: /etc/resolv.conf
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
serializeImagePulls: false
registerNode: true
"""


def kube_proxy_config(layout: NodeLayout, kubeconfig: Path) -> str:
    # conntrack 0: leave the kernel's conntrack table size and timeouts as they are (shared with the host).
    return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {kubeconfig.resolve()}}}
mode: iptables
clusterCIDR: {cluster_cidr(layout.pod_ip_base)}
hostnameOverride: {layout.name}
bindAddress: {layout.ip}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""
