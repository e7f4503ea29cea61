"""The kubelet nodes' layout and configuration files, without starting anything: names fit the kernel's
limits, no two nodes or clusters share an address range, and each file parses and says what the machines
here need (e2e/test_kubelet_node.py starts them for real)."""

from __future__ import annotations

import ipaddress
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from flotilla.cluster import control_plane, node_configs
from flotilla.cluster.node_layout import NodeLayout, bridge_name, cluster_cidr, host_ip

STATE = Path("/tmp/flotilla-node-config-test")


def test_interface_names_fit_the_kernels_limit_at_the_largest_base_and_index():
    layout = NodeLayout(STATE, 150, 99)
    assert len(layout.host_veth) <= 15 and len(bridge_name(150)) <= 15


def test_no_two_nodes_or_clusters_share_a_range_and_none_meets_the_service_range():
    services = ipaddress.ip_network(control_plane.SERVICE_CIDR)
    layouts = [NodeLayout(STATE, base, i) for base in (1, 7, 9) for i in range(3)]
    pods = [ipaddress.ip_network(layout.pod_cidr) for layout in layouts]
    for a, (layout, net) in enumerate(zip(layouts, pods, strict=True)):
        assert not net.overlaps(services)
        assert all(not net.overlaps(other) for other in pods[a + 1 :])
        assert net.subnet_of(ipaddress.ip_network(cluster_cidr(layout.pod_ip_base)))  # type: ignore[arg-type]
    bridges = [ipaddress.ip_interface(f"{host_ip(base)}/24").network for base in (1, 7, 9)]
    assert len(set(bridges)) == 3
    assert ipaddress.ip_address(NodeLayout(STATE, 7, 2).ip) in bridges[1]


def test_a_base_outside_the_ranges_is_refused_naming_it():
    with pytest.raises(ValueError, match="pod_ip_base 200"):
        NodeLayout(STATE, 200, 0).ip  # noqa: B018


def test_containerd_lets_runc_start_here_and_uses_cgroupfs():
    config = tomllib.loads(node_configs.containerd_toml(NodeLayout(STATE, 7, 0)))
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"] == {"BinaryName": node_configs.RUNC, "SystemdCgroup": False}


def test_the_kubelet_runs_on_cgroup_v1_under_its_own_root_and_never_collects_imported_images():
    layout = NodeLayout(STATE, 7, 1)
    config = yaml.safe_load(node_configs.kubelet_config(layout, STATE / "pki"))
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == "/flotilla-7-1" != NodeLayout(STATE, 7, 0).cgroup_root
    assert config["imageGCHighThresholdPercent"] == 100
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["address"] == layout.ip and config["podCIDR"] == layout.pod_cidr


def test_the_pod_network_is_the_nodes_range_and_kube_proxy_knows_the_clusters():
    layout = NodeLayout(STATE, 9, 0)
    bridge = json.loads(node_configs.cni_conflist(layout))["plugins"][0]
    assert bridge["ipam"]["ranges"] == [[{"subnet": layout.pod_cidr}]]
    proxy = yaml.safe_load(node_configs.kube_proxy_config(layout, STATE / "kp.kubeconfig"))
    assert proxy["clusterCIDR"] == cluster_cidr(9) and proxy["mode"] == "iptables"
    assert proxy["conntrack"]["maxPerCore"] == 0  # the host's conntrack table is left alone


def test_the_api_server_listens_for_nodes_only_when_there_are_kubelet_nodes():
    plain = control_plane.ClusterConfig(state_dir=STATE)
    nodes = control_plane.ClusterConfig(state_dir=STATE, kubelet_nodes=1, pod_ip_base=9)
    assert "--bind-address=127.0.0.1" in control_plane._argv(plain, "kube-apiserver")
    argv = control_plane._argv(nodes, "kube-apiserver")
    assert f"--advertise-address={host_ip(9)}" in argv and "--authorization-mode=Node,RBAC" in argv
