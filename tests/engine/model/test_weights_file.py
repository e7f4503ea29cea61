"""A weights file Flotilla writes is readable by the engine's user, not only its writer: safetensors alone
makes it 0600, and a kubelet running the engine image as uid 65532 then cannot load a folder root wrote
(e2e/test_kubelet_node.py serves one). A stricter umask is still honoured."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from flotilla.engine.model.synthetic.weights_file import save_weights_file


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_a_weights_file_has_the_mode_the_umask_gives_any_other_file(tmp_path, umask: int, mode: int):
    previous = os.umask(umask)
    try:
        save_weights_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == mode
