"""A naive paged-attention oracle and a random paged batch builder, shared by the kernel tests.

The oracle walks each sequence's block table in Python, gathers its K/V into dense tensors
and runs causal softmax attention in fp32. It shares no code with any backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runtime.attention.base import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D], the new tokens' K (already in the cache)
    value: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    block_ids: list[list[int]]  # each sequence's block table, unpadded


def make_paged_batch(
    chunks: list[tuple[int, int]],  # per sequence (cached_len, num_new_tokens); decodes first
    num_decodes: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random cache contents everywhere; blocks handed out in a shuffled order (block 0 too).

    The new tokens' K/V are written into their slots here, in Python, so attention tests do
    not depend on the store kernel.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in chunks]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns, full of noise
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids, taken = [], 0
    for count in blocks_per_seq:
        block_ids.append(order[taken : taken + count])
        taken += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    num_tokens = sum(new for _, new in chunks)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    query, key, value = (randn(num_tokens, h, head_dim) for h in (num_heads,) + (num_kv_heads,) * 2)
    slots = []
    for (cached, new), table in zip(chunks, block_ids, strict=True):
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + new)
        ]
    for token, slot in enumerate(slots):
        k_cache[slot // block_size, slot % block_size] = key[token]
        v_cache[slot // block_size, slot % block_size] = value[token]
    meta = make_metadata(chunks, num_decodes, block_ids, slots, device)
    to = lambda t: t.to(device)  # noqa: E731
    return PagedBatch(to(query), to(key), to(value), to(k_cache), to(v_cache), meta, block_ids)


def make_metadata(
    chunks: list[tuple[int, int]],
    num_decodes: int,
    block_ids: list[list[int]],
    slots: list[int],
    device: str = "cpu",
) -> AttentionMetadata:
    seq_lens = [cached + new for cached, new in chunks]
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    width = max((len(t) for t in block_ids), default=1)
    tables = [t + [0] * (width - len(t)) for t in block_ids]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens, default=0),
        max_query_len=max((new for _, new in chunks), default=0),
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )


def visible_keys(positions: torch.Tensor, seq_len: int, window: int | None) -> torch.Tensor:
    """[Tq, S] bool: which of the seq_len keys each query position sees, written from the
    contract's words: a query at position p sees keys max(0, p - W + 1) .. p (all up to p
    without a window)."""
    keys = torch.arange(seq_len)[None, :]
    queries = positions[:, None]
    visible = keys <= queries
    if window is not None:
        visible &= keys >= (queries - window + 1).clamp(min=0)
    return visible


def reference_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_ids: list[list[int]],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [T, H, D] in dtype
    """Dense causal attention per sequence over K/V gathered position by position (within
    the last `window` positions for a sliding-window layer); shares no code with a backend."""
    block_size = k_cache.shape[1]
    group_size = query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=dtype)
    starts = meta.query_start_loc_host
    for seq, seq_len in enumerate(meta.seq_lens_host):
        if seq_len == 0:
            continue  # a padded decode row: no keys, output 0
        table = block_ids[seq]
        blocks = torch.tensor([table[p // block_size] for p in range(seq_len)], dtype=torch.long)
        offsets = torch.arange(seq_len) % block_size
        keys = k_cache.cpu()[blocks, offsets].to(dtype)  # [S, Hkv, D]
        values = v_cache.cpu()[blocks, offsets].to(dtype)
        keys = keys.repeat_interleave(group_size, dim=1)  # [S, H, D]
        values = values.repeat_interleave(group_size, dim=1)
        q = query[starts[seq] : starts[seq + 1]].cpu().to(dtype)  # [Tq, H, D]
        positions = torch.arange(seq_len - q.shape[0], seq_len)  # [Tq]
        visible = visible_keys(positions, seq_len, window)  # [Tq, S]
        scores = torch.einsum("thd,shd->hts", q, keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[seq] : starts[seq + 1]] = torch.einsum("hts,shd->thd", probs, values)
    return out


def windowed_reference(query, k_cache, v_cache, block_ids, meta, scale, window) -> torch.Tensor:
    """reference_attention with a window, in float64: the oracle of the window tests."""
    return reference_attention(
        query, k_cache, v_cache, block_ids, meta, scale, window, dtype=torch.float64
    )
