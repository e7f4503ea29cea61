"""Greedy sampling's argmax (kernels/greedy.py): the C library's must give torch's `max(dim=-1).indices`
exactly, first maximum on ties and NaN counted as the maximum, in every build."""

from __future__ import annotations

import pytest
import torch

from flotilla.engine.kernels import greedy


@pytest.fixture
def argmax_build(c_build, monkeypatch):
    """greedy.py's function from the native build, or from the build without AVX-512 (conftest.py)."""
    if c_build is not None:
        fn = c_build.flotilla_argmax_rows_f32
        fn.argtypes, fn.restype = greedy.ARGMAX_ARGS, None
        monkeypatch.setattr(greedy, "_argmax_rows", lambda: fn)
    assert greedy._argmax_rows() is not None, "the C library must build here"


def _torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 64, 8192, 32001])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_first_maximum_of_every_row_as_torch_finds_it(argmax_build, cols, threads):
    g = torch.Generator().manual_seed(cols)
    # Few distinct values: many ties, so "first" is checked, at every position in the row.
    logits = torch.randint(-3, 4, (37, cols), generator=g).float()
    before = logits.clone()
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = greedy.first_max_indices(logits)
    finally:
        torch.set_num_threads(default)
    assert got.dtype == torch.int64 and torch.equal(got, _torch(logits))
    assert torch.equal(logits, before)


def test_a_maximum_in_the_last_lanes_and_rows_of_minus_infinity_and_nan(argmax_build):
    logits = torch.randn(6, 21)
    logits[0, 20] = 100.0  # past the last full vector
    logits[1, 16] = 100.0  # the first lane of the last full vector
    logits[2] = float("-inf")  # no finite value: index 0, as torch
    logits[3, 5], logits[3, 11] = float("nan"), float("nan")  # NaN is the maximum: the first one
    logits[4, 19] = float("nan")
    logits[5, 0], logits[5, 1] = float("inf"), float("inf")
    got = greedy.first_max_indices(logits)
    assert got.tolist() == [20, 16, 0, 5, 19, 0]
    assert torch.equal(got, _torch(logits))


def test_what_the_c_library_does_not_take_goes_to_torch():
    """bfloat16, a strided view, a row of nothing: the same answers through torch's reduction."""
    logits = torch.randn(5, 40)
    assert torch.equal(greedy.first_max_indices(logits.bfloat16()), _torch(logits.bfloat16()))
    view = logits[:, ::2]
    assert torch.equal(greedy.first_max_indices(view), _torch(view))
    assert greedy.first_max_indices(torch.empty(0, 40)).shape == (0,)
