"""Over any sequence of loads, unloads, requests, aborts and steps: no adapter slot or KV block leaks, at
most --max-loras adapters run at once, and no request ever runs with another adapter's weights (each
scheduled row's slot holds that request's adapter when the forward runs)."""

from __future__ import annotations

import contextlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.engine.core.lora_slots import NO_SLOT
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.lora.errors import LoRAInUse, UnknownLoRA

from ..test_hf_parity import make_engine

NAMES = ["n0", "n1", "n2", "n3"]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.sampled_from(NAMES), st.integers(0, 2)),
        st.tuples(st.just("unload"), st.sampled_from(NAMES)),
        st.tuples(st.just("add"), st.sampled_from([None, *NAMES]), st.integers(1, 30), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=40,
)


def check_rows(engine, out) -> None:
    weights = engine.runner.lora_weights
    slots = engine.scheduler.lora_slots
    assert len(slots.running_adapters()) <= slots.num_slots
    for item in out.scheduled:
        name = item.request.lora_name
        if name is None:
            assert item.lora_slot == NO_SLOT
        else:
            assert weights.slot_contents[item.lora_slot] == name, (
                "a request ran with another adapter's weights"
            )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_no_slot_or_block_leaks_and_no_request_runs_with_another_adapters_weights(
    hf_models, lora_adapters, program
):
    folder, _base = hf_models("llama-gqa")
    paths = [str(path) for path, _ref in lora_adapters("llama-gqa").values()]
    engine = make_engine(folder, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3,
                         kv_cache_memory=1 << 16, max_num_batched_tokens=16)  # fmt: skip
    execute = engine.runner.execute

    def checked(out):
        result = execute(out)
        check_rows(engine, out)  # after the fill: the slots as the forward saw them
        return result

    engine.runner.execute = checked
    ids: list[str] = []
    for op in program:
        kind = op[0]
        if kind == "load":
            try:
                engine.load_lora(op[1], paths[op[2]])
            except ValueError as exc:  # taken, or no room: refused before anything is read
                assert "already loaded" in str(exc) or "--max-cpu-loras" in str(exc)
        elif kind == "unload":
            with contextlib.suppress(UnknownLoRA, LoRAInUse):  # not loaded, or requests use it
                engine.unload_lora(op[1])
        elif kind == "add":
            name, length, max_tokens = op[1], op[2], op[3]
            if name is not None and name not in engine.loras:
                continue
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            ids.append(engine.add_request(list(range(2, 2 + length)), params, lora_name=name).request_id)
        elif kind == "abort" and ids:
            engine.abort(ids[op[1] % len(ids)])
        elif kind == "step":
            for _ in range(op[1]):
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks
    assert not any(engine.scheduler.lora_slots.users)
    loaded = set(engine.loras.names())
    assert {n for n in engine.scheduler.lora_slots.contents if n} <= loaded
    assert {n for n in engine.runner.lora_weights.slot_contents if n} <= loaded
