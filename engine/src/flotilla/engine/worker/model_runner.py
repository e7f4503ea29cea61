"""Runs one forward pass over a scheduled batch: builds the flat inputs and the paged-attention metadata,
owns the KV cache tensors, and samples."""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from flotilla.engine.config import EngineConfig, blocks_for_budget
from flotilla.engine.core.outputs import ModelInfo
from flotilla.engine.core.request import Request
from flotilla.engine.core.scheduler import SchedulerOutput
from flotilla.engine.kernels.attention import AttentionMetadata, TorchAttentionBackend
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.loader import load_model, resolve_device, resolve_dtype
from flotilla.engine.model.quantize import bf16_weight_bytes, kernels_in_use, weight_bytes
from flotilla.engine.worker.sampler import SAMPLER_LABEL, Sampler, SampleResult

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def pick_backend(name: str, device: torch.device):
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    from flotilla.engine.kernels.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        if model_config.sliding_window:
            # Attention here is never windowed: keep to lengths where a window changes nothing.
            max_len = min(max_len, model_config.sliding_window)
        self.max_model_len = max_len
        torch.manual_seed(config.seed)
        self.model = load_model(
            config.model,
            self.dtype,
            self.device,
            max_len,
            config.show_progress,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
        )
        int4 = config.quantization == "int4"
        self.model_info = ModelInfo(
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=config.quantization,
            quantization_group_size=config.quantization_group_size if int4 else None,
            weight_bytes=weight_bytes(self.model),
            bf16_weight_bytes=bf16_weight_bytes(self.model),
            kernels=kernels_in_use(self.model),
        )
        log.info("model %s: %s", config.model, self.model_info.describe())
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        if self.num_blocks * self.block_size < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens, less than max_model_len=%d; lowering max_model_len",
                self.num_blocks * self.block_size,
                self.max_model_len,
            )
            self.max_model_len = self.num_blocks * self.block_size
        shape = (self.num_blocks, self.block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]
        self.backend = pick_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device)

    def _num_kv_blocks(self) -> int:
        bytes_per_token = self.model_config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = CPU_DEFAULT_KV_BYTES
        blocks = blocks_for_budget(budget, bytes_per_token, self.block_size)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no KV block "
                f"(one block of {self.block_size} tokens takes {bytes_per_token * self.block_size} bytes)"
            )
        return blocks

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens, seq_lens, tables = [], [], []
        decode_reqs, prefill_reqs, decode_rows = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for r, item in enumerate(out.scheduled):
            req, n, start = item.request, item.num_new_tokens, item.num_computed_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_reqs.append(r)
                decode_rows.append(query_start[-1])
            else:
                prefill_reqs.append(r)
            query_start.append(query_start[-1] + n)
            context_lens.append(start)
            seq_lens.append(start + n)
            tables.append(blocks)
            if item.samples:
                sample_rows.append(query_start[-1] - 1)
                sample_requests.append(req)
        width = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev),
            query_start=query_start,
            context_lens=context_lens,
            seq_lens=seq_lens,
            block_tables=table_tensor.to(dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            decode_requests=decode_reqs,
            prefill_requests=prefill_reqs,
            decode_token_index=torch.tensor(decode_rows, dtype=torch.long).to(dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(dev)
        pos = torch.tensor(positions, dtype=torch.long).to(dev)
        return ids, pos, meta, sample_rows, sample_requests

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SampleResult]:
        # The thread count is per calling thread under OpenMP, and a server steps on its own thread.
        threads = self.config.cpu_threads
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        ids, pos, meta, sample_rows, sample_requests = self._prepare(out)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        if not sample_requests:
            return [], SampleResult([], [])
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        with record_function(SAMPLER_LABEL):
            return sample_requests, self.sampler(logits, sample_requests)
