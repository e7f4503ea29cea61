"""CUDA graphs' pure parts: which batch sizes are captured, which one a batch pads to, and the settings
refused at start-up. The padded static-buffer path itself is checked against transformers in
test_hf_parity.py; the capture needs a GPU (`flotilla engine bench gpu`)."""

from __future__ import annotations

import argparse

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine_args import add_engine_args, engine_config_from_args
from flotilla.engine.worker.cuda_graphs import capture_sizes, padded_size


def test_default_sizes_are_small_powers_of_two_then_every_16_up_to_the_batch_limit():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    big = capture_sizes(1024)
    assert big[-1] == 256 and big[4:7] == [16, 32, 48] and len(big) == 4 + 16
    assert capture_sizes(64, [8, 1, 8]) == [1, 8]


@pytest.mark.parametrize("batch,size", [(1, 1), (3, 4), (8, 8), (9, 16), (17, 32), (64, 64), (65, None)])
def test_a_batch_runs_at_the_smallest_captured_size_that_holds_it(batch, size):
    assert padded_size(capture_sizes(64), batch) == size


@pytest.mark.parametrize("sizes,bad", [([0], 0), ([4, 300], 300)])
def test_sizes_outside_one_to_max_num_seqs_are_refused_with_the_limit(sizes, bad):
    with pytest.raises(
        ValueError, match=rf"--cuda-graph-sizes {bad}: .* between 1 and --max-num-seqs \(256\)"
    ):
        EngineConfig(model="m", cuda_graph_sizes=sizes)


def test_the_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--enforce-eager", "--cuda-graph-sizes", "1,2,8"])
    config = engine_config_from_args(args)
    assert config.enforce_eager and config.cuda_graph_sizes == [1, 2, 8]
    assert not engine_config_from_args(parser.parse_args(["--model", "m"])).enforce_eager
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--cuda-graph-sizes", "0,4"])
