"""`flotilla demo` with no cluster: a clear error, a non-zero exit, and nothing started."""

import subprocess
import sys


def test_demo_without_a_cluster_says_how_to_start_one(tmp_path):
    state = tmp_path / "no-cluster"
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "demo", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert f"no cluster in {state}" in proc.stderr and "flotilla cluster up" in proc.stderr, proc.stderr
    assert not state.exists()  # no operator, no pid table, no model written
