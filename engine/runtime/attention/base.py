"""The attention interface every backend implements (torch reference, Triton).

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, Hkv, D].
A token's slot is block_id * block_size + offset; slot_mapping[i] says where token i of the
flattened batch writes its K/V. Sequences reach their KV only through their block table.

Axes: T tokens in the flattened batch, B sequences, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer.

    The first `num_decodes` sequences have exactly one query token each; the rest are prefill
    chunks, which attend to their cached context (positions < start) plus themselves, causally.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each table's end
    num_decodes: int
    max_seq_len: int
    max_query_len: int
    # Host copies (python ints) so the CPU path can loop over prefills without device syncs.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # [T] int32, each token's projection path where the model's are GGUF blocks: 1 on AMX tiles
    # (a prompt token, where the runner puts those there: step_inputs.tile_rows), 0 on the
    # FMAs; None (the runner does not use the tiles): every row on the kernels' default path.
    tile_rows: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """Write the new tokens' K/V into their slots (in place)."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each query token over its sequence's paged context.

        window: a sliding-window layer's width W; a query at position p then sees the keys at
        positions max(0, p - W + 1) .. p only (the last W, itself included: transformers'
        sliding_window). None: every position up to p."""
        ...

    def copy_blocks(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        src_block_ids: torch.Tensor,  # [N] int64
        dst_block_ids: torch.Tensor,  # [N] int64
    ) -> None:
        """Copy-on-write: copy whole blocks src -> dst in every layer (in place)."""
        ...


def kernel_window(window: int | None) -> int:
    """A native or Triton kernel's window argument: the width W, or 0 for none (so a width is
    never 0); raises ValueError for a width below 1."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return window
