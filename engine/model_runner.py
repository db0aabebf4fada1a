"""Owns the model and the paged KV tensors; turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.select import get_attention_backend
from engine.batch import (
    BlockCopy,
    ModelRunnerOutput,
    SampleSpec,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.config import EngineConfig
from engine.loader import load_model
from engine.models.llama import LlamaSpec
from engine.protocol import ModelInfo
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
_GIB = float(1 << 30)


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype | str) -> int:
    """KV bytes one token takes across all layers: 2 (K and V) * layers * Hkv * D * itemsize."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    spec = LlamaSpec.from_hf_config(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> float32 on CPU, bfloat16 on CUDA; otherwise the named torch dtype."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


@dataclass
class StepInputs:
    """One step's tensors on the device, plus which rows get sampled."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] flattened row of each sampled sequence's last token
    sample_seq_ids: list[int]
    sample_specs: list[SampleSpec]


def prepare_inputs(sched_out: SchedulerOutput, device: torch.device) -> StepInputs:
    """Flatten a SchedulerOutput into tensors with a single host-to-device transfer."""
    seqs = sched_out.seqs
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc, seq_lens, logits_indices = [0], [], []
    sampled = [(s.seq_id, s.sample) for s in seqs if s.sample is not None]
    for seq in seqs:
        input_ids += seq.token_ids
        positions += range(seq.start_pos, seq.context_len)
        query_start_loc.append(query_start_loc[-1] + seq.num_tokens)
        seq_lens.append(seq.context_len)
        if seq.sample is not None:
            logits_indices.append(query_start_loc[-1] - 1)
    _check_batch(sched_out, len(input_ids))
    width = max(len(seq.block_ids) for seq in seqs)
    tables = [b for seq in seqs for b in seq.block_ids + [0] * (width - len(seq.block_ids))]
    parts = (input_ids, positions, sched_out.slot_mapping, query_start_loc, seq_lens)
    ids, pos, slots, qsl, lens, logits_rows, table_flat = _to_device(
        [*parts, logits_indices, tables], device
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl.int(),
        seq_lens=lens.int(),
        block_tables=table_flat.view(len(seqs), width).int(),
        num_decodes=sched_out.num_decodes,
        max_seq_len=max(seq_lens),
        max_query_len=max(seq.num_tokens for seq in seqs),
        query_start_loc_host=query_start_loc,
        seq_lens_host=seq_lens,
    )
    return StepInputs(ids, pos, meta, logits_rows, [i for i, _ in sampled], [s for _, s in sampled])


def _to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device`, one per list, moved in a single host-to-device copy."""
    host = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(p) for p in parts]))


def _check_batch(sched_out: SchedulerOutput, num_tokens: int) -> None:
    # Cheap python checks: a malformed batch would otherwise write KV into wrong slots.
    if len(sched_out.slot_mapping) != num_tokens:
        raise ValueError(
            f"slot_mapping has {len(sched_out.slot_mapping)} slots for {num_tokens} tokens"
        )
    if any(seq.num_tokens != 1 for seq in sched_out.seqs[: sched_out.num_decodes]):
        raise ValueError("every decode sequence must schedule exactly one token")


class ModelRunner:
    """Loads the model, allocates the KV pool, and runs one step at a time.

    Public attributes: device, dtype, model, hf_config, max_model_len, block_size,
    bytes_per_block, num_kv_blocks, kv_caches (per layer (k, v), each
    [num_kv_blocks, block_size, Hkv, D]), attn_backend, sampler, model_info.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._load_model()
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.model_info.eos_token_ids)
        self.block_size = config.block_size
        self.bytes_per_block = self.block_size * kv_bytes_per_token(self.hf_config, self.dtype)
        self.num_kv_blocks = self._size_kv_pool()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self._log_capacity()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply copy-on-write copies, run the forward over the batch, sample its last tokens."""
        if sched_out.block_copies:
            self._copy_blocks(sched_out.block_copies)
        if sched_out.is_empty:
            return ModelRunnerOutput()
        self._check_seqs(sched_out.seqs)
        inputs = prepare_inputs(sched_out, self.device)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, self.attn_backend
            )  # [T, E]
            if not inputs.sample_specs:
                return ModelRunnerOutput()
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
            sampled = self.sampler(logits, inputs.sample_specs)
        return ModelRunnerOutput(dict(zip(inputs.sample_seq_ids, sampled, strict=True)))

    def _check_seqs(self, seqs: list[ScheduledSeq]) -> None:
        for seq in seqs:
            if seq.context_len > self.max_model_len:
                raise ValueError(
                    f"sequence {seq.seq_id} reaches {seq.context_len} tokens, "
                    f"past max_model_len {self.max_model_len}"
                )
            if len(seq.block_ids) * self.block_size < seq.context_len:
                raise ValueError(
                    f"sequence {seq.seq_id} has {len(seq.block_ids)} blocks "
                    f"for {seq.context_len} tokens"
                )

    def _load_model(self) -> None:
        loaded = load_model(self.config, self.device, self.dtype)
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.model_info = ModelInfo(
            name=loaded.name,
            tokenizer_path=loaded.tokenizer_path,
            max_model_len=loaded.max_model_len,
            vocab_size=loaded.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            weights_version=loaded.weights_version,
        )

    def _size_kv_pool(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_bytes is not None:
            budget = self.config.kv_cache_bytes
        elif self.device.type == "cpu":
            budget = _CPU_DEFAULT_KV_BYTES
        else:
            budget = self._cuda_kv_budget()
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget ({budget} bytes) holds no block of {self.bytes_per_block} bytes"
            )
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes for KV: utilisation * total memory, minus what is in use, minus activation peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        self._warm_up(num_tokens)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        logger.info(
            "CUDA memory: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak",
            total / _GIB,
            (total - free) / _GIB,
            activation_peak / _GIB,
        )
        return max(0, int(budget))

    def _warm_up(self, num_tokens: int) -> None:
        """One dummy prefill of num_tokens through a temporary pool (measures the peak)."""
        num_blocks = math.ceil(num_tokens / self.block_size)
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        spec = SampleSpec(
            greedy, seeds=[0], output_index=0, prompt_token_ids=[], output_token_ids=[]
        )
        seq = ScheduledSeq(0, [0] * num_tokens, 0, list(range(num_blocks)), sample=spec)
        self.execute(SchedulerOutput(seqs=[seq], slot_mapping=list(range(num_tokens))))
        del self.kv_caches

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = LlamaSpec.from_hf_config(self.hf_config)
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(spec.num_layers)
        ]

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=self.device)
        self.attn_backend.copy_blocks(self.kv_caches, src, dst)

    def _log_capacity(self) -> None:
        num_tokens = self.num_kv_blocks * self.block_size
        full_context_seqs = num_tokens // self.max_model_len
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s on %s); "
            "%d sequences fit at full context (%d tokens)",
            self.num_kv_blocks,
            self.block_size,
            num_tokens,
            self.num_kv_blocks * self.bytes_per_block / _GIB,
            str(self.dtype).removeprefix("torch."),
            self.device,
            full_context_seqs,
            self.max_model_len,
        )
        if full_context_seqs < 1:
            logger.warning("the KV pool holds fewer tokens than one full-context sequence")
