"""Triton attention kernels over the paged KV pool: decode (split-K) and prefill.

KV layout per layer: [num_blocks, block_size, Hkv, D]; token n of a sequence lives in block
block_table[n // block_size] at offset n % block_size. Every kernel reads K/V straight from
the pool through the block table: nothing is gathered into a contiguous tensor.

The attention kernels pack the G = H // Hkv query heads that share one KV head into the rows
of one tile ("rows" = query token x head in group), so each K/V tile is loaded once per group.
Softmax runs online in fp32, in base 2 (scores are pre-multiplied by scale * log2(e)).
A sliding window (kernel argument `window`, 0 = none) starts each key loop at the first key
any row of the program sees, so a local layer reads about W keys however long the context.

Compiles with Triton 3.6 (the GPU image) and 3.9. Under TRITON_INTERPRET=1 they also run on
the CPU (the tests), if triton is imported after the variable is set: triton.jit picks the
interpreter when it decorates. Triton 3.6's interpreter fails with numpy >= 2.4; 3.9's works.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.runtime.attention.base import kernel_window

# Whether the kernels below were built for the interpreter (triton.jit reads the variable once,
# when it decorates). The interpreter computes bf16 dots on raw bits, so dots are done in fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
_ATTENTION_ROWS = 64  # rows (query token x head in group) per prefill tile, at D <= 128
_TILE_N = 64  # keys per inner-loop step at D <= 128; any block size, tiles may straddle blocks
_MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs
# Wider heads take proportionally fewer rows and keys per tile, so a tile's registers and
# shared memory stay what they are at D = 128 (Gemma 3's D = 256 would double them).
_TILE_HEAD_DIM = 128


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _tile_size_for(size: int, d_pad: int) -> int:
    """`size` rows or keys at D <= 128, scaled down for wider (padded) head dims."""
    return max(_MIN_DOT, size * _TILE_HEAD_DIM // max(d_pad, _TILE_HEAD_DIM))


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    return INTERPRETED or dtype == torch.float32


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        # exact fp32 (no tf32) for the fp32 path; the interpreter takes this path for bf16 too
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _first_visible(pos, window):
    """The first key position a query at `pos` sees (window 0: no window, key 0)."""
    return tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)


@triton.jit
def _attend(
    q,  # [ROWS, D_PAD], zero in padded rows and dims
    q_pos,  # [ROWS] absolute position of each row's token: it sees keys 0..q_pos
    kv_start, kv_end,  # key range [kv_start, kv_end) of this program
    window,  # > 0: a row sees only keys q_pos - window + 1 .. q_pos
    k_cache_ptr, v_cache_ptr, block_table_ptr,  # block_table_ptr: this sequence's row
    kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, head_dim, scale_log2,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
    TILE_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [kv_start, kv_end): unnormalised acc, row max, row sum (base 2)."""
    dims = tl.arange(0, D_PAD)
    dim_mask = dims < head_dim
    # finite start so a row whose keys are all masked in a tile never computes inf - inf
    row_max = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    for tile_start in range(kv_start, kv_end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_mask = n < kv_end
        block_ids = tl.load(block_table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
        rows_at = (
            block_ids.to(tl.int64) * stride_cache_block
            + (n % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + rows_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        # k, v: [TILE_N, D_PAD]; s: [ROWS, TILE_N]
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2
        in_window = (window == 0) | (n[None, :] > q_pos[:, None] - window)
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None]) & in_window
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.exp2(row_max - new_max)  # rescales what was summed under the old max
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_heads, group_size, head_dim, num_splits, window, scale_log2,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
    TILE_N: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv_head, split): the group's query heads over one slice of the context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The slices cut the visible keys [kv_lo, seq_len) into whole tiles; they come from the
    # device seq_len, so any num_splits is correct (surplus slices are empty).
    kv_lo = _first_visible(seq_len - 1, window)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), TILE_N) * TILE_N
    kv_start = kv_lo + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    rows = tl.arange(0, ROWS)  # row = head within the group
    dims = tl.arange(0, D_PAD)
    heads = kv_head * group_size + rows
    mask = (rows < group_size)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(query_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=mask, other=0.0)  # fmt: skip
    q_pos = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
    acc, row_max, row_sum = _attend(
        q, q_pos, kv_start, kv_end, window,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
        kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, head_dim, scale_log2,
        BLOCK_SIZE, ROWS, D_PAD, TILE_N, DOT_FP32,
    )  # fmt: skip
    # an empty slice (or a padded row with seq_len 0) has row_sum 0: output 0, weight 0
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if SPLIT:
        # partials: [num_decodes, H, num_splits, D_PAD] and lse [num_decodes, H, num_splits]
        at = (seq * num_heads + heads) * num_splits + split
        has_keys = row_sum > 0
        lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + at, lse, mask=rows < group_size)
        tl.store(partial_out_ptr + at[:, None] * D_PAD + dims[None, :], out, mask=mask)
    else:
        out_at = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_ot, stride_oh, num_heads, head_dim, num_splits,
    S_PAD: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Program (seq, head): combine the split partials with their log-sum-exp weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    at = (seq * num_heads + head) * num_splits + splits  # [S_PAD]
    lse = tl.load(partial_lse_ptr + at, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every slice empty
    weights = tl.exp2(lse - lse_max)  # [S_PAD], 0 for empty slices
    total = tl.sum(weights, 0)
    parts_mask = (splits < num_splits)[:, None] & (dims < head_dim)[None, :]
    parts = tl.load(partial_out_ptr + at[:, None] * D_PAD + dims[None, :], mask=parts_mask,
                    other=0.0)  # fmt: skip
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_at = out_ptr + seq * stride_ot + head * stride_oh + dims
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def paged_decode(
    query: torch.Tensor,  # [T, H, D]; rows 0..num_decodes-1 are the decode tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [T, H, D], rows 0..num_decodes-1 are written
    num_decodes: int,
    scale: float,
    num_splits: int = 1,
    window: int | None = None,
) -> None:
    """One query token per sequence for the first num_decodes sequences (token i = seq i).

    With num_splits > 1 each (sequence, KV head) context, the keys the window leaves visible,
    is cut into num_splits slices of whole tiles, attended in parallel, then merged by a
    log-sum-exp reduce kernel. The result does not depend on num_splits beyond rounding.
    """
    if num_decodes == 0:
        return
    check_last_dim_contiguous(query, k_cache, v_cache, out)
    num_heads, head_dim = query.shape[1], query.shape[2]
    group_size = num_heads // k_cache.shape[2]
    d_pad = pow2_at_least(head_dim, _MIN_DOT)
    is_split = num_splits > 1
    partial_out = partial_lse = out  # unused placeholders without split
    if is_split:
        partial_out = torch.empty(
            (num_decodes, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_decodes, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    _decode_kernel[(num_decodes, k_cache.shape[2], num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, group_size, head_dim, num_splits, kernel_window(window), scale * LOG2E,
        BLOCK_SIZE=k_cache.shape[1], ROWS=pow2_at_least(group_size, _MIN_DOT), D_PAD=d_pad,
        TILE_N=_tile_size_for(_TILE_N, d_pad), SPLIT=is_split, DOT_FP32=_dot_in_fp32(query.dtype),
    )  # fmt: skip
    if is_split:
        _reduce_splits_kernel[(num_decodes, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1),
            num_heads, head_dim, num_splits,
            S_PAD=pow2_at_least(num_splits), D_PAD=d_pad,
        )  # fmt: skip


@triton.jit
def _prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_decodes, group_size, head_dim, window, scale_log2,
    BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr, TOKENS: tl.constexpr, D_PAD: tl.constexpr,
    TILE_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (prefill seq, query tile, kv_head): TOKENS new tokens x the group's heads."""
    seq = num_decodes + tl.program_id(0)
    first = tl.program_id(1) * TOKENS  # first query index (within the chunk) of this tile
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - q_len  # the chunk's tokens sit at positions cached_len.. seq_len-1

    rows = tl.arange(0, TOKENS * G_PAD)  # row = (query token, head in group)
    q_idx = first + rows // G_PAD
    heads = kv_head * group_size + rows % G_PAD
    dims = tl.arange(0, D_PAD)
    row_mask = (q_idx < q_len) & (rows % G_PAD < group_size)
    mask = row_mask[:, None] & (dims < head_dim)[None, :]
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=mask, other=0.0)  # fmt: skip
    # the tile's first token sees the furthest back; its last (causal) up to the tile's end
    kv_start = _first_visible(cached_len + first, window)
    kv_end = tl.minimum(seq_len, cached_len + first + TOKENS)
    acc, _, row_sum = _attend(
        q, cached_len + q_idx, kv_start, kv_end, window,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
        kv_head, stride_cache_block, stride_cache_slot, stride_cache_head, head_dim, scale_log2,
        BLOCK_SIZE, TOKENS * G_PAD, D_PAD, TILE_N, DOT_FP32,
    )  # fmt: skip
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    out_at = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_prefill(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, cached + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out: torch.Tensor,  # [T, H, D], the prefill sequences' rows are written
    num_decodes: int,
    max_query_len: int,
    scale: float,
    window: int | None = None,
) -> None:
    """Sequences num_decodes..B-1: each new token attends causally to its cached prefix + chunk
    (within the window, if any: see AttentionBackend.forward).

    The chunk's own K/V must already be in the pool (store_kv runs first). max_query_len only
    sizes the grid (tiles past a sequence's chunk return at once), so an upper bound works.
    """
    num_prefills = seq_lens.shape[0] - num_decodes
    if num_prefills <= 0 or max_query_len <= 0:
        return
    check_last_dim_contiguous(query, k_cache, v_cache, out)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    g_pad = pow2_at_least(group_size)
    d_pad = pow2_at_least(head_dim, _MIN_DOT)
    tokens_per_tile = max(_tile_size_for(_ATTENTION_ROWS, d_pad) // g_pad, 1)  # rows >= 16
    grid = (num_prefills, triton.cdiv(max_query_len, tokens_per_tile), num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_decodes, group_size, head_dim, kernel_window(window), scale * LOG2E,
        BLOCK_SIZE=k_cache.shape[1], G_PAD=g_pad, TOKENS=tokens_per_tile, D_PAD=d_pad,
        TILE_N=_tile_size_for(_TILE_N, d_pad), DOT_FP32=_dot_in_fp32(query.dtype),
    )  # fmt: skip


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels index the head dim with stride 1; other strides are passed in."""
    for tensor in tensors:
        assert tensor.stride(-1) == 1, f"last dim must be contiguous, got strides {tensor.stride()}"
