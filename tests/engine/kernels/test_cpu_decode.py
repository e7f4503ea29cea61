"""The CPU attention backend the engine picks, what the compiled decode kernel refuses and why (its numbers
against dense attention are in test_attention.py), and the oneDNN linear layer against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flotilla.engine.config import EngineConfig
from flotilla.engine.kernels import c_library, cpu_decode
from flotilla.engine.kernels.linear import ONEDNN_DTYPES, Linear, uses_onednn
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.worker.model_runner import pick_backend


@pytest.mark.parametrize(
    "sizes,field",
    [((68, 8, 8, 16), "head_dim 68"), ((512, 8, 8, 16), "head_dim 512"),
     ((64, 64, 2, 16), "64 heads over 2 KV heads"), ((64, 8, 8, 128), "block_size 128")],
)  # fmt: skip
def test_sizes_past_the_kernel_are_refused_with_the_size_and_the_limit(sizes, field):
    head_dim, heads, kv_heads, block_size = sizes
    reason = cpu_decode.unusable(torch.device("cpu"), torch.float32, head_dim, heads, kv_heads, block_size)
    assert reason is not None and reason.startswith(field)
    k = torch.zeros(2, block_size, kv_heads, head_dim)
    with pytest.raises(ValueError, match=field):
        cpu_decode.paged_decode(
            torch.zeros(1, heads, head_dim), k, k, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0,
        )  # fmt: skip


def model(head_dim=64, heads=8, kv_heads=4) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=head_dim * heads, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, bos_token_id=None,
        eos_token_ids=[], torch_dtype=None,
    )  # fmt: skip


def test_auto_picks_the_kernel_for_float32_and_bfloat16_on_the_cpu_and_torch_otherwise():
    cpu = torch.device("cpu")
    assert pick_backend("auto", cpu, torch.float32, 16, [model()]).name == "cpu"
    assert pick_backend("auto", cpu, torch.bfloat16, 16, [model()]).name == "cpu"
    assert pick_backend("auto", cpu, torch.float16, 16, [model()]).name == "torch"
    assert pick_backend("torch", cpu, torch.float32, 16, [model()]).name == "torch"
    # A draft whose heads the kernel does not handle keeps both models on the torch path.
    assert pick_backend("auto", cpu, torch.float32, 16, [model(), model(head_dim=68)]).name == "torch"


def test_asking_for_the_cpu_backend_where_it_cannot_serve_says_why():
    cpu = torch.device("cpu")
    with pytest.raises(
        ValueError,
        match=r"--attention-backend cpu: it reads float32 and bfloat16 caches, the dtype is float16",
    ):
        pick_backend("cpu", cpu, torch.float16, 16, [model()])
    with pytest.raises(ValueError, match=r"--attention-backend cpu: head_dim 68"):
        pick_backend("cpu", cpu, torch.float32, 16, [model(head_dim=68)])
    with pytest.raises(
        ValueError, match="attention_backend must be one of auto, torch, cpu, triton, got 'fast'"
    ):
        EngineConfig(model="m", attention_backend="fast")


def test_a_failing_compiler_is_reported_and_leaves_no_files(tmp_path):
    target = tmp_path / "kernels" / "paged_decode.so"
    with pytest.raises(
        c_library.KernelUnavailable, match="failed on paged_decode.c, paged_prefill.c, cpu_ops.c"
    ):
        c_library._build("false", target)
    assert list(target.parent.iterdir()) == []


def test_the_onednn_linear_matches_f_linear_and_keeps_autograd():
    layer = Linear(48, 40, bias=True)
    x = torch.randn(5, 48)
    with torch.inference_mode():
        assert uses_onednn(x, layer.weight) == torch.backends.mkldnn.is_available()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert not uses_onednn(x.half(), layer.weight.half())
        assert not uses_onednn(x.bfloat16(), layer.weight)  # mixed dtypes: F.linear says what is wrong
        bf16 = Linear(48, 40, bias=True).bfloat16()
        assert uses_onednn(x.bfloat16(), bf16.weight) == (torch.bfloat16 in ONEDNN_DTYPES)
        # Both add in float32 and round once to bfloat16.
        torch.testing.assert_close(bf16(x.bfloat16()), F.linear(x.bfloat16(), bf16.weight, bf16.bias))
    # With autograd on (a trainer, a test) it is F.linear: gradients flow.
    assert not uses_onednn(x, layer.weight)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (40, 48)


def test_packing_for_the_cpu_keeps_the_outputs_and_leaves_shared_weights_plain():
    from torch import nn

    from flotilla.engine.kernels.linear import pack_for_cpu

    model = nn.Module()
    model.embed = nn.Embedding(40, 48)
    model.proj = Linear(48, 40, bias=True)
    model.head = Linear(48, 40, bias=False)
    model.head.weight = model.embed.weight  # tied, like an LM head sharing the embedding
    model.bf16 = Linear(48, 40).bfloat16()
    model.fp16 = Linear(48, 40).half()
    x = torch.randn(7, 48)
    with torch.inference_mode():
        before = model.proj(x), model.head(x), model.bf16(x.bfloat16())
    if not torch.backends.mkldnn.is_available():
        assert pack_for_cpu(model) == 0
        return
    bf16_packed = torch.bfloat16 in ONEDNN_DTYPES
    # proj, and bf16 where the CPU runs bfloat16 in oneDNN; head is shared, fp16 is float16.
    assert pack_for_cpu(model) == 1 + bf16_packed
    assert model.proj.weight.is_mkldnn and not model.head.weight.is_mkldnn and not model.fp16.weight.is_mkldnn
    assert model.bf16.weight.is_mkldnn == bf16_packed
    assert model.head.weight is model.embed.weight
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), before[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.head(x), before[1])
        torch.testing.assert_close(model.bf16(x.bfloat16()), before[2])
        assert model.proj(torch.randn(300, 48)).shape == (300, 40)  # any batch size, not only the packed one
    assert pack_for_cpu(model) == 0  # idempotent


def test_the_engines_wheel_carries_every_file_the_c_library_compiles():
    """An installed engine (its image) builds the library from the package's own files: a source or header
    left out of the package data leaves every CPU kernel unavailable there."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[3] / "engine" / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"][
        "flotilla.engine.kernels"
    ]
    missing = [
        path.name
        for path in (*c_library.SOURCES, *c_library.HEADERS)
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)
    ]
    assert not missing, f"not in flotilla.engine.kernels' package data: {missing}"
