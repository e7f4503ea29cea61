"""Bad input to the kubelet-node commands: refused before anything starts or is built, naming the flag or
the state folder and the rule."""

from __future__ import annotations

from flotilla.cli import main


def test_a_negative_kubelet_node_count_is_refused_naming_the_flag(capsys):
    assert main(["cluster", "up", "--kubelet-nodes", "-1", "--no-build"]) == 1
    assert "--kubelet-nodes must be at least 0, got -1" in capsys.readouterr().err


def test_no_agent_nodes_is_refused_unless_there_are_kubelet_nodes(capsys):
    assert main(["cluster", "up", "--nodes", "0", "--no-build"]) == 1
    assert "--nodes must be at least 1, got 0" in capsys.readouterr().err


def test_loading_an_image_without_kubelet_nodes_names_the_folder_and_the_way_out(tmp_path, capsys):
    assert main(["cluster", "load-image", "some/image:1", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no cluster with kubelet nodes in {tmp_path}" in err and "--kubelet-nodes N" in err
