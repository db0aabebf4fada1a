"""Triton kernels that move KV in the paged pool: store new tokens, copy blocks (copy-on-write).

KV layout per layer: [num_blocks, block_size, Hkv, D]; slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.runtime.attention.triton_kernels import check_last_dim_contiguous, pow2_at_least

_COPY_CHUNK = 1024  # elements per program in copy_blocks
# copy_blocks moves raw bits: bf16/fp16 as int16 (the interpreter mis-handles bf16 pointers)
_BITS_DTYPE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to write
        return
    heads = tl.arange(0, HKV_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block_id * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst + dims, k, mask=mask)
    tl.store(v_cache_ptr + dst + dims, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], < 0 for padding tokens
) -> None:
    """Write each token's K/V into its slot, in place. Padding slots (< 0) are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_last_dim_contiguous(key, value, k_cache, v_cache)
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HKV_PAD=pow2_at_least(num_kv_heads),
        D_PAD=pow2_at_least(head_dim),
    )  # fmt: skip


# The pool's pointer tables, by their pointers: the KV pool is never reallocated, so a step's
# copy-on-write finds its table here rather than copying one from pageable host memory, which
# would make the host wait for the GPU.
_POINTER_TABLES: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_MAX_POINTER_TABLES = 8


def _pointer_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """One pointer per cache tensor, on their device, so a single launch covers every layer."""
    device = caches[0].device
    key = (device, tuple(cache.data_ptr() for cache in caches))
    table = _POINTER_TABLES.get(key)
    if table is None:
        if len(_POINTER_TABLES) >= _MAX_POINTER_TABLES:  # tests make many small pools
            _POINTER_TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64, device=device)
        _POINTER_TABLES[key] = table
    return table


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr, src_ptr, dst_ptr, block_numel,
    ELEMENT: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program (cache tensor, pair, chunk): copy one chunk of block src into block dst."""
    cache = tl.load(cache_ptrs_ptr + tl.program_id(0)).to(tl.pointer_type(ELEMENT))
    pair = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    chunk = tl.load(cache + src * block_numel + offsets, mask=mask)
    tl.store(cache + dst * block_numel + offsets, chunk, mask=mask)


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
    src_block_ids: torch.Tensor,  # [N] int64
    dst_block_ids: torch.Tensor,  # [N] int64
) -> None:
    """Copy whole blocks src -> dst in every layer's K and V cache, in one launch.

    Every cache must be contiguous with the same shape and dtype. dst ids must be distinct and
    never appear among the src ids (copy-on-write targets are freshly allocated blocks), so the
    copies do not depend on each other's order.
    """
    num_pairs = src_block_ids.shape[0]
    if num_pairs == 0 or not kv_caches:
        return
    caches = [cache for pair in kv_caches for cache in pair]
    first = caches[0]
    for cache in caches:
        assert cache.is_contiguous(), "copy_blocks needs contiguous caches"
        assert cache.shape == first.shape and cache.dtype == first.dtype, "caches must match"
    cache_ptrs = _pointer_table(caches)
    block_numel = first[0].numel()
    grid = (len(caches), num_pairs, triton.cdiv(block_numel, _COPY_CHUNK))
    _copy_blocks_kernel[grid](
        cache_ptrs, src_block_ids, dst_block_ids, block_numel,
        ELEMENT=_BITS_DTYPE[first.element_size()], CHUNK=_COPY_CHUNK,
    )  # fmt: skip
