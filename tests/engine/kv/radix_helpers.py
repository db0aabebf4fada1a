"""Helpers the radix-cache tests share."""

from __future__ import annotations

from engine.core.sequence import make_namespace
from engine.kv.radix_cache import RadixCache

NS = make_namespace("w1")


def cached(cache: RadixCache, tokens: list[int], namespace=NS) -> list[int]:
    """Allocate blocks for tokens' full blocks, insert them, then let the sequence go."""
    bs = cache.block_size
    block_ids = [cache.pool.allocate() for _ in range(len(tokens) // bs)]
    cache.insert(namespace, tokens[: len(block_ids) * bs], block_ids)
    for block_id in block_ids:
        cache.pool.decref(block_id)
    cache.check_integrity()
    return block_ids
