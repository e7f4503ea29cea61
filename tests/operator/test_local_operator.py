"""The local operator launcher leaves nothing running when the operator never becomes healthy."""

import pytest

from flotilla.cluster.processes import ProcessTable
from flotilla.operator.cmd.local import OperatorProcess


def test_an_operator_that_never_becomes_healthy_is_stopped_and_forgotten(tmp_path):
    table = ProcessTable(tmp_path / "pids")
    operator = OperatorProcess(tmp_path / "missing.kubeconfig", tmp_path / "operator.log")
    with pytest.raises(AssertionError, match="operator"):
        operator.start(table=table, timeout=5)
    assert operator.proc is not None and operator.proc.poll() is not None
    assert table.running("operator") is None and "operator" not in table.names()
