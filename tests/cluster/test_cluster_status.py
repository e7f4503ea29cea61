"""`flotilla cluster status` exits like `systemctl status`: 0 when running, 3 when not."""

import subprocess
import sys

from flotilla.cluster.cli import STATUS_NOT_RUNNING, STATUS_RUNNING, status_exit_code
from flotilla.cluster.control_plane import ClusterConfig


def _status(state_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "cluster", "status", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_of_an_empty_state_dir_exits_3(tmp_path):
    result = _status(tmp_path)
    assert result.returncode == 3, result.stderr
    assert "stopped" in result.stdout and "no cluster in" in result.stdout


def test_status_of_a_stopped_cluster_exits_3(tmp_path):
    ClusterConfig(state_dir=tmp_path).save()  # what `up` leaves behind after `down`
    result = _status(tmp_path)
    assert result.returncode == 3, result.stderr
    assert "export KUBECONFIG=" in result.stdout


def _components(*running: bool) -> dict[str, dict]:
    return {f"c{i}": {"running": up, "pid": 100 + i if up else None} for i, up in enumerate(running)}


def test_only_a_fully_running_cluster_exits_0():
    assert status_exit_code(_components(True, True, True)) == STATUS_RUNNING == 0
    assert status_exit_code(_components(False, False, False)) == STATUS_NOT_RUNNING == 3


def test_a_partial_cluster_counts_as_not_running():
    assert status_exit_code(_components(True, False, True)) == STATUS_NOT_RUNNING
