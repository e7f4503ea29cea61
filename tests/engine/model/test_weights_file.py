"""A weights file Flotilla writes is readable by the engine's user, not only its writer: safetensors alone
makes it 0600, and a kubelet running the engine image as uid 65532 then cannot load a folder root wrote
(e2e/test_kubelet_node.py serves one)."""

from __future__ import annotations

import os
import stat

import torch

from flotilla.engine.model.synthetic.weights_file import save_weights_file


def test_a_weights_file_is_readable_by_others_under_the_usual_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        save_weights_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode)
    assert mode == 0o644, oct(mode)


def test_a_stricter_umask_is_still_honoured(tmp_path):
    previous = os.umask(0o077)
    try:
        save_weights_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o600
