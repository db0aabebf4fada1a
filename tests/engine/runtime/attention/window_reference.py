"""A dense sliding-window attention oracle for the Triton kernel tests, in float64.

Each sequence's K/V is gathered position by position through its block table, scores form
one dense [H, Tq, S] matrix, and the mask is written from the contract's words: a query at
position p sees keys max(0, p - W + 1) .. p. It shares no code with any backend.
"""

from __future__ import annotations

import torch

from engine.runtime.attention.base import AttentionMetadata


def visible_keys(positions: torch.Tensor, seq_len: int, window: int | None) -> torch.Tensor:
    """[Tq, S] bool: which of the seq_len keys each query position sees."""
    keys = torch.arange(seq_len)[None, :]
    queries = positions[:, None]
    visible = keys <= queries
    if window is not None:
        visible &= keys >= (queries - window + 1).clamp(min=0)
    return visible


def windowed_reference(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_ids: list[list[int]],
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, H, D] float64
    block_size = k_cache.shape[1]
    group_size = query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = meta.query_start_loc_host
    for seq, seq_len in enumerate(meta.seq_lens_host):
        if seq_len == 0:
            continue  # a padded decode row: no keys, output 0
        key_positions = torch.arange(seq_len)
        blocks = torch.tensor(block_ids[seq], dtype=torch.long)[key_positions // block_size]
        offsets = key_positions % block_size
        # keys, values: [S, Hkv, D] -> [S, H, D]
        keys = k_cache.cpu()[blocks, offsets].double().repeat_interleave(group_size, dim=1)
        values = v_cache.cpu()[blocks, offsets].double().repeat_interleave(group_size, dim=1)
        q = query[starts[seq] : starts[seq + 1]].cpu().double()  # [Tq, H, D]
        positions = torch.arange(seq_len - q.shape[0], seq_len)  # [Tq]
        scores = torch.einsum("thd,shd->hts", q, keys) * scale  # [H, Tq, S]
        visible = visible_keys(positions, seq_len, window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[seq] : starts[seq + 1]] = torch.einsum("hts,shd->thd", probs, values)
    return out
