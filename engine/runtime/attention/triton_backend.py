"""TritonBackend: the AttentionBackend for CUDA, reading K/V straight from the paged pool.

Decodes (the first num_decodes sequences, one token each) go to the split-K decode kernel;
prefill chunks go to the prefill kernel, which attends to the cached prefix plus the chunk.
A sliding-window layer's kernels read only the keys inside its window.
On the CPU it runs only under TRITON_INTERPRET=1 (the tests), and slowly.
"""

from __future__ import annotations

import torch

from engine.core.intmath import cdiv
from engine.runtime.attention import triton_cache_ops, triton_kernels
from engine.runtime.attention.base import AttentionMetadata

_MAX_SPLITS = 16
_MIN_TOKENS_PER_SPLIT = 256  # shorter slices cost more in the reduce than they save
_CPU_NUM_SMS = 4  # the interpreter has no SMs; any small number keeps splitting testable


class TritonBackend:
    """Paged attention in Triton kernels; see engine/runtime/attention/base.py for the contract.

    `num_splits`: a fixed number of split-K slices for decode (1 = no split); None picks one
    per step from the batch shape (host ints only, so no device sync and no effect on results).
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits
        self._num_sms: dict[torch.device, int] = {}

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        triton_cache_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_decodes > 0:
            # a decode token sees at most `window` keys: split those, not the whole context
            max_visible = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
            num_splits = self.num_splits or self.choose_num_splits(
                meta.num_decodes, k_cache.shape[2], max_visible, query.device
            )
            triton_kernels.paged_decode(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, out,
                meta.num_decodes, scale, num_splits, window,
            )  # fmt: skip
        if meta.num_seqs > meta.num_decodes:
            triton_kernels.paged_prefill(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                out, meta.num_decodes, meta.max_query_len, scale, window,
            )  # fmt: skip
        return out

    def copy_blocks(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        src_block_ids: torch.Tensor,  # [N] int64
        dst_block_ids: torch.Tensor,  # [N] int64
    ) -> None:
        triton_cache_ops.copy_blocks(kv_caches, src_block_ids, dst_block_ids)

    def choose_num_splits(
        self, num_decodes: int, num_kv_heads: int, max_seq_len: int, device: torch.device
    ) -> int:
        """Split long contexts until about two programs per SM; a power of two (few compiles)."""
        num_programs = num_decodes * num_kv_heads
        wanted = cdiv(2 * self._sm_count(device), num_programs)
        by_length = max_seq_len // _MIN_TOKENS_PER_SPLIT
        num_splits = max(1, min(wanted, by_length, _MAX_SPLITS))
        return 1 << (num_splits.bit_length() - 1)

    def _sm_count(self, device: torch.device) -> int:
        if device.type != "cuda":
            return _CPU_NUM_SMS
        if device not in self._num_sms:
            props = torch.cuda.get_device_properties(device)
            self._num_sms[device] = props.multi_processor_count
        return self._num_sms[device]
