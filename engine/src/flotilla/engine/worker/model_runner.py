"""Runs one forward pass over a scheduled batch: builds the flat inputs and the paged-attention metadata,
owns the KV cache tensors, and samples, or verifies drafts (rejection_sampler.py). With a draft model it
also owns the draft proposer, whose KV cache shares the target's block layout (draft_proposer.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flotilla.engine.config import EngineConfig, blocks_for_budget
from flotilla.engine.core.lora_slots import NO_SLOT
from flotilla.engine.core.outputs import ModelInfo, SampledLogprob
from flotilla.engine.core.resolved import Resolved
from flotilla.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from flotilla.engine.kernels import cpu_attention, cpu_decode
from flotilla.engine.kernels.attention import TorchAttentionBackend
from flotilla.engine.kernels.linear import pack_for_cpu
from flotilla.engine.kernels.lora import Segment
from flotilla.engine.kernels.profiling import profiler_range
from flotilla.engine.lora.layers import LoRAWeights
from flotilla.engine.lora.registry import LoRARegistry
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.loader import load_model, resolve_device, resolve_dtype
from flotilla.engine.model.quantize import bf16_weight_bytes, kernels_in_use, weight_bytes
from flotilla.engine.worker.batch import BatchRow, build_batch
from flotilla.engine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from flotilla.engine.worker.draft_proposer import DraftProposer
from flotilla.engine.worker.kv_storage import zeroed
from flotilla.engine.worker.rejection_sampler import RejectionSampler
from flotilla.engine.worker.sampler import SAMPLER_LABEL, Sampler

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def pick_backend(
    name: str, device: torch.device, dtype: torch.dtype, block_size: int, models: list[ModelConfig]
):
    """`auto`: Triton on CUDA; on the CPU the compiled decode kernel where it serves (float32 or bfloat16, a C
    compiler, head sizes it handles for every model it serves: the target and any draft), else the torch
    path. Asking for `cpu` where it cannot serve is an error that says why."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from flotilla.engine.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name in ("cpu", "auto"):
        reason = next(
            filter(None, (cpu_decode.unusable(device, dtype, *heads(m), block_size) for m in models)), None
        )
        if reason is None:
            return cpu_attention.CpuAttentionBackend()
        if name == "cpu":
            raise ValueError(f"--attention-backend cpu: {reason}")
        log.info("attention backend torch: the cpu kernel does not serve here (%s)", reason)
    return TorchAttentionBackend()


def heads(model: ModelConfig) -> tuple[int, int, int]:
    return model.head_dim, model.num_attention_heads, model.num_key_value_heads


def lora_segments(items: list[ScheduledRequest], query_start: list[int]) -> list[Segment]:
    """The runs of consecutive rows whose requests share an adapter slot (base rows: none)."""
    segments: list[Segment] = []
    for index, item in enumerate(items):
        if item.lora_slot == NO_SLOT:
            continue
        start, end = query_start[index], query_start[index + 1]
        if segments and segments[-1][2] == item.lora_slot and segments[-1][1] == start:
            segments[-1] = (segments[-1][0], end, item.lora_slot)
        else:
            segments.append((start, end, item.lora_slot))
    return segments


@dataclass
class StepResult:
    # Per request that sampled: its new tokens (one, or the accepted drafts and one more).
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # Per request that asked for logprobs (never a speculating one): those of its one token.
    logprobs: dict[str, SampledLogprob | None] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, draft_config: ModelConfig | None = None
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.draft_config = draft_config
        # The values the flags leave open are decided here, once, and kept in self.resolved: the runner
        # reads them from there like everyone else. The torch forms of the device and dtype stay here too.
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        if model_config.sliding_window:
            # Attention here is never windowed: keep to lengths where a window changes nothing.
            max_len = min(max_len, model_config.sliding_window)
        torch.manual_seed(config.seed)
        self.model = load_model(
            config.model,
            self.dtype,
            self.device,
            max_len,
            config.show_progress,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
            config=model_config,
        )
        dtype_name = str(self.dtype).removeprefix("torch.")
        int4 = config.quantization == "int4"
        model_info = ModelInfo(
            dtype=dtype_name,
            quantization=config.quantization,
            quantization_group_size=config.quantization_group_size if int4 else None,
            weight_bytes=weight_bytes(self.model),
            bf16_weight_bytes=bf16_weight_bytes(self.model),
            kernels=kernels_in_use(self.model),
        )
        log.info("model %s: %s", config.model, model_info.describe())
        pack_for_cpu(self.model)  # after the weight sizes above: packed weights have no plain storage
        num_blocks = self._num_kv_blocks()
        if num_blocks * config.block_size < max_len:
            log.warning(
                "the KV cache holds %d tokens, less than max_model_len=%d; lowering max_model_len",
                num_blocks * config.block_size,
                max_len,
            )
            max_len = num_blocks * config.block_size
        self.resolved = Resolved(
            max_model_len=max_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            prefix_caching=config.enable_prefix_caching,
            dtype=dtype_name,
            device=str(self.device),
            vocab_size=model_config.vocab_size,
            model_info=model_info,
        )
        # One block more than the pool hands out: the scratch block CUDA graphs' padding rows write to.
        self.scratch_block = self.num_blocks
        shape = (
            self.num_blocks + 1,
            self.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        self.kv_caches = [
            (zeroed(shape, self.dtype, self.device), zeroed(shape, self.dtype, self.device))
            for _ in range(model_config.num_hidden_layers)
        ]
        self.backend = pick_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            self.block_size,
            [model_config, *filter(None, [draft_config])],
        )
        self.sampler = Sampler(self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.drafter: DraftProposer | None = None
        if draft_config is not None and config.speculative_model:
            self.drafter = DraftProposer(
                config.speculative_model,
                draft_config,
                device=self.device,
                dtype=self.dtype,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                backend=self.backend,
                sampler=self.sampler,
                show_progress=config.show_progress,
            )
        # LoRA: adapters in host memory (the registry) and in device slots (the wrapped linear layers).
        self.loras: LoRARegistry | None = None
        self.lora_weights: LoRAWeights | None = None
        if config.enable_lora:
            self.loras = LoRARegistry(
                model_config, set(), config.max_lora_rank, config.max_cpu_loras, self.dtype
            )
            self.lora_weights = LoRAWeights(
                self.model, model_config, config.max_loras, config.max_lora_rank, self.device, self.dtype
            )
            log.info(
                "LoRA: %d slots of rank %d, %.1f MiB each",
                config.max_loras,
                config.max_lora_rank,
                self.lora_weights.slot_bytes / 2**20,
            )
        self.graphs: DecodeGraphs | None = None
        # Decode graphs replay fixed kernels; a step's LoRA segments change with its batch, so LoRA runs eager.
        if (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not config.enforce_eager
            and not config.enable_lora
        ):
            self.enable_decode_graphs(capture=True)

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.resolved.num_blocks

    @property
    def block_size(self) -> int:
        return self.resolved.block_size

    def enable_decode_graphs(self, capture: bool) -> None:
        """Decode steps through DecodeGraphs: captured CUDA graphs, or (capture=False, what the CPU tests
        run) the same static buffers and padding run eagerly."""

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

        self.graphs = DecodeGraphs(
            forward,
            capture_sizes(self.config.max_num_seqs, self.config.cuda_graph_sizes),
            device=self.device,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            scratch_block=self.scratch_block,
            capture=capture,
        )
        try:
            with torch.inference_mode():
                self.graphs.capture_all(log.info if self.config.show_progress else lambda _msg: None)
        except Exception as exc:  # an op that cannot be captured: serve, kernel by kernel
            if not capture:
                raise
            log.warning("CUDA graph capture failed, decode steps run without graphs: %s", exc)
            self.graphs = None

    def _num_kv_blocks(self) -> int:
        dtype_size = torch.finfo(self.dtype).bits // 8
        bytes_per_token = self.model_config.kv_bytes_per_token(dtype_size)
        if self.draft_config is not None:
            bytes_per_token += self.draft_config.kv_bytes_per_token(dtype_size)  # its cache shares the blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = CPU_DEFAULT_KV_BYTES
        block_size = self.config.block_size
        blocks = blocks_for_budget(budget, bytes_per_token, block_size)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no KV block "
                f"(one block of {block_size} tokens takes {bytes_per_token * block_size} bytes)"
            )
        return blocks

    def _fill_lora_slots(self, items: list[ScheduledRequest]) -> None:
        """Copies into each slot this step uses the adapter the scheduler put there, where the slot holds
        another (or none)."""
        assert self.lora_weights is not None and self.loras is not None
        for item in items:
            slot, name = item.lora_slot, item.request.lora_name
            if slot != NO_SLOT and self.lora_weights.slot_contents[slot] != name:
                assert name is not None
                self.lora_weights.fill(slot, self.loras.get(name))

    def forget_lora(self, name: str) -> None:
        """An unloaded adapter leaves its device slot."""
        if self.lora_weights is not None and name in self.lora_weights.slot_contents:
            self.lora_weights.clear(self.lora_weights.slot_contents.index(name))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        # The thread count is per calling thread under OpenMP, and a server steps on its own thread.
        threads = self.config.cpu_threads
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        items = out.scheduled
        if self.lora_weights is not None:
            # Requests of one adapter side by side: one segment (two matmuls per layer) per adapter.
            items = sorted(items, key=lambda item: item.lora_slot)
            self._fill_lora_slots(items)
        rows = []
        for item in items:
            request, start = item.request, item.num_computed_tokens
            known = request.all_token_ids[start : start + item.num_new_tokens - len(item.spec_token_ids)]
            rows.append(BatchRow(known + item.spec_token_ids, start, request.block_ids))
        if self.graphs is not None and self.graphs.covers(rows):
            hidden = self.graphs.run(rows)
            row_ends = list(range(1, len(rows) + 1))
        else:
            batch = build_batch(rows, self.block_size, self.device)
            if self.lora_weights is not None:
                self.lora_weights.step.set(lora_segments(items, batch.meta.query_start))
            try:
                hidden = self.model(
                    batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend
                )
            finally:
                if self.lora_weights is not None:
                    self.lora_weights.step.set(())
            row_ends = batch.row_ends
        # The rows whose logits pick tokens: a sampling request's last, and one more per draft before it.
        sample_rows: list[int] = []
        sampling = []
        for item, end in zip(items, row_ends, strict=True):
            if item.samples:
                sample_rows.extend(range(end - 1 - len(item.spec_token_ids), end))
                sampling.append(item)
        result = StepResult()
        if not sampling:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        with profiler_range(SAMPLER_LABEL):
            plain_rows, plain_requests, offset = [], [], 0
            for item in sampling:
                request, k = item.request, len(item.spec_token_ids)
                if k:
                    drafts_probs = self.drafter.take_probs(request.request_id) if self.drafter else None
                    result.tokens[request.request_id] = self.rejection_sampler(
                        logits[offset : offset + k + 1],
                        request,
                        item.spec_token_ids,
                        None if drafts_probs is None else drafts_probs[:k],
                    )
                else:
                    plain_rows.append(offset)
                    plain_requests.append(request)
                offset += k + 1
            if plain_requests:
                # Without drafts in the step every row samples: no copy of the logits.
                plain = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
                sampled = self.sampler(plain, plain_requests)
                for request, token, logprob in zip(
                    plain_requests, sampled.token_ids, sampled.logprobs, strict=True
                ):
                    result.tokens[request.request_id] = [token]
                    result.logprobs[request.request_id] = logprob
        return result
