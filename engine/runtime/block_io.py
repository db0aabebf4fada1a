"""A KV block's bytes out of the paged pool and back in (the second tier's spills and loads).

A block's bytes are every layer's K then V block, in layer order, each as the pool stores it
(kv_caches[layer] = (k, v), each [num_blocks, ...]); whatever the dtype, the bytes are exact.
Loads write what spills read, so a restored block is bit-identical to the block evicted.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.batch import BlockLoad

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
CHUNK_BLOCKS = 64  # blocks moved at a time: the staging copies stay small beside the pool


def block_nbytes(kv_caches: KVCaches) -> int:
    """Bytes of one block over all layers, K and V."""
    return sum(cache[0].numel() * cache.element_size() for pair in kv_caches for cache in pair)


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> list[bytes]:
    """The bytes of each block, in order (copied to the host, CHUNK_BLOCKS at a time)."""
    found: list[bytes] = []
    for start in range(0, len(block_ids), CHUNK_BLOCKS):
        found += _read_chunk(kv_caches, block_ids[start : start + CHUNK_BLOCKS])
    return found


def _read_chunk(kv_caches: KVCaches, block_ids: list[int]) -> list[bytes]:
    device = kv_caches[0][0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    parts = [
        cache.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
        for pair in kv_caches
        for cache in pair
    ]
    rows = torch.cat(parts, dim=1).cpu().numpy()
    return [row.tobytes() for row in rows]


def write_blocks(kv_caches: KVCaches, loads: list[BlockLoad]) -> None:
    """Write each load's payload (bytes of read_blocks()) into its block, CHUNK_BLOCKS at a
    time; a block listed twice gets its last payload."""
    expected = block_nbytes(kv_caches)
    for load in loads:
        if len(load.payload) != expected:
            raise ValueError(f"block {load.block_id}: {len(load.payload)} bytes, not {expected}")
    last = list({load.block_id: load for load in loads}.values())
    for start in range(0, len(last), CHUNK_BLOCKS):
        _write_chunk(kv_caches, last[start : start + CHUNK_BLOCKS], expected)


def _write_chunk(kv_caches: KVCaches, loads: list[BlockLoad], expected: int) -> None:
    device = kv_caches[0][0].device
    host = np.frombuffer(b"".join(load.payload for load in loads), dtype=np.uint8)
    data = torch.from_numpy(host.copy()).view(len(loads), expected).to(device)
    index = torch.tensor([load.block_id for load in loads], dtype=torch.long, device=device)
    offset = 0
    for pair in kv_caches:
        for cache in pair:
            nbytes = cache[0].numel() * cache.element_size()
            part = data[:, offset : offset + nbytes].contiguous().view(cache.dtype)
            cache.index_copy_(0, index, part.view(len(loads), *cache.shape[1:]))
            offset += nbytes
