"""The CPU backend: the torch reference with decode attention in a native kernel.

Decode attention on the torch path gathers every sequence's blocks into a dense copy, then runs
SDPA under a padding mask: on this CPU that is most of a decode step's non-matmul time. The
paged decode kernel of engine/runtime/cpu/paged_attention.cpp reads K/V in place through the
block tables instead. engine/runtime/cpu/native.py compiles the kernel library on first use, for
the ISA level the CPU probe (engine/runtime/cpu/capabilities.py) picks, and loads it; the same
library carries the fused RMSNorm / SiLU-and-mul / rope that engine/runtime/cpu/fused.py wraps
for the model. Prefill chunks run there too: each query of a chunk is a decode query at its own
position over the sequence's block table, so a chunk reads the cached K/V in place instead of
gathering a dense copy of the whole context per layer, which made short chunks of long prompts
(what the fair-share prefill cap produces) expensive on the torch path; and a token's attention
is computed the same way whichever chunk, or decode step, it falls in. Measured per layer
(SmolLM2 shapes, 2 threads): a 512-token first chunk 1.9 ms against 3.8 on SDPA, 16 tokens after
1,000 cached 0.25 against 0.38 (benchmarks/README.md, "Prefill attention in the paged kernel").
A sliding window (Gemma 3's local layers) runs there too: every row, decode or chunk query, sees
the last `window` positions of its own context. KV stores and block copies stay on the torch
path.

No compiler, a failed build, or a shape/dtype the kernel does not cover (float16 activations, head
dims other than 64/128/256, more than 8 query heads per KV head, groups other than 1/2/4/8 at
256: kvshare_supports_shape) all fall back to the torch path, so results never depend on it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.intmath import cdiv
from engine.runtime.attention.base import AttentionMetadata, kernel_window
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu.native import DTYPE_CODES, cache_dtype_code, load_library


@dataclass(frozen=True)
class _StepTables:
    """A step's decode rows as the kernel reads them, converted and checked once per step."""

    meta: AttentionMetadata  # every layer of a step shares this object
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    max_seq_len: int
    max_block_id: int
    # _covers() per (query, cache) shapes and dtypes: every layer asks the same, once is enough.
    covers: dict[tuple, bool] = field(default_factory=dict)


class CpuNativeBackend(TorchRefBackend):
    """TorchRefBackend whose decode attention runs in the native paged kernel."""

    name = "cpu"

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # its fused elementwise ops serve the model (cpu/fused.py)
        self._decode_fn = library.kvshare_paged_decode
        self._supports_shape = library.kvshare_supports_shape
        self._step: _StepTables | None = None

    def _decode(
        self,
        query: torch.Tensor,  # [B, H, D], one token per sequence
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        step = self._step_tables(meta, num_seqs)
        key = (query.shape, query.dtype, query.device, k_cache.shape, k_cache.dtype)
        key += (v_cache.shape, v_cache.dtype)
        covered = step.covers.get(key)
        if covered is None:
            covered = step.covers[key] = self._covers(
                query, k_cache, v_cache, step.max_seq_len, step.block_tables.shape[1],
                step.max_block_id,
            )  # fmt: skip
        if not (covered and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return super()._decode(query, k_cache, v_cache, meta, scale, window)
        query = query.contiguous()
        out = torch.empty_like(query)
        status = self._decode_fn(
            DTYPE_CODES[query.dtype],
            cache_dtype_code(query.dtype, k_cache.dtype),
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            step.block_tables.data_ptr(),
            step.seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            step.block_tables.shape[1],
            scale,
            torch.get_num_threads(),
            kernel_window(window),
        )
        if status != 0:
            raise RuntimeError(f"native paged decode failed with status {status}")
        return out

    def _prefill(
        self,
        query: torch.Tensor,  # [n, H, D], the chunk's queries
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [max_blocks]
        seq_len: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """A chunk as n decode queries: query i at position start + i sees seq_len
        start + i + 1 through the sequence's own blocks (causal by construction), and with a
        window the last `window` of those positions, as a decode query there would."""
        num_queries, num_heads, head_dim = query.shape
        start = seq_len - num_queries
        num_blocks = cdiv(seq_len, k_cache.shape[1])
        table = block_table[:num_blocks]
        if not self._covers_chunk(query, k_cache, v_cache, table, seq_len):
            return super()._prefill(query, k_cache, v_cache, block_table, seq_len, scale, window)
        tables = table.to(torch.int32)[None].expand(num_queries, num_blocks).contiguous()
        seq_lens = torch.arange(start + 1, seq_len + 1, dtype=torch.int32)  # [n]
        query = query.contiguous()
        out = torch.empty_like(query)
        status = self._decode_fn(
            DTYPE_CODES[query.dtype], cache_dtype_code(query.dtype, k_cache.dtype),
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), num_queries, num_heads, k_cache.shape[2],
            head_dim, k_cache.shape[1], num_blocks, scale, torch.get_num_threads(),
            kernel_window(window),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native paged decode failed with status {status}")
        return out

    def _covers_chunk(self, query, k_cache, v_cache, table: torch.Tensor, seq_len: int) -> bool:
        """_covers for one prefill chunk's own table (ids below 0 never reach the kernel)."""
        if not table.numel() or int(table.min()) < 0:
            return False
        return self._covers(query, k_cache, v_cache, seq_len, table.numel(), int(table.max()))

    def _step_tables(self, meta: AttentionMetadata, num_seqs: int) -> _StepTables:
        if self._step is None or self._step.meta is not meta:
            tables = meta.block_tables[:num_seqs]
            self._step = _StepTables(
                meta,
                tables.to(torch.int32).contiguous(),
                meta.seq_lens[:num_seqs].to(torch.int32).contiguous(),
                max(meta.seq_lens_host[:num_seqs], default=0),
                int(tables.max()) if tables.numel() else 0,
            )
        return self._step

    def _covers(
        self, query, k_cache, v_cache, max_seq_len: int, table_width: int, max_block_id: int
    ) -> bool:
        """Whether the kernel handles this call; it reads raw pointers, so check everything
        it assumes (anything else takes the torch path)."""
        _, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        return (
            cache_dtype_code(query.dtype, k_cache.dtype) is not None
            and query.device.type == "cpu"
            and k_cache.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and num_heads % num_kv_heads == 0
            and bool(self._supports_shape(head_dim, num_heads // num_kv_heads))
            and max_seq_len <= table_width * block_size
            and max_block_id < num_blocks
        )


def create_backend(build_dir: Path, isa: str | None = None) -> CpuNativeBackend:
    """Build (or reuse) the kernel library for `isa` (default: the probe's level) under
    build_dir; raises engine.runtime.cpu.native.NativeBuildError."""
    return CpuNativeBackend(load_library(build_dir, isa))
