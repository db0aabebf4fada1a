"""KVCacheManager.check_integrity(): every reference accounted for, recounted from scratch
(torch-free; a walk of the pool and the tree, for tests and checks, never per step)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from engine.core.sequence import Sequence

if TYPE_CHECKING:
    from engine.kv.kv_cache_manager import KVCacheManager


def check_integrity(kv: KVCacheManager, live_seqs: list[Sequence]) -> None:
    """Raise AssertionError unless the refcount of every block == live block-table references
    + other holders' + the tree's, the tree agrees with the pool, and locks, insert records
    and the quarantine belong to live sequences and held blocks."""
    pool = kv.pool
    pool.check_integrity()
    if kv.prefix_cache is not None:
        kv.prefix_cache.check_integrity()
    live_ids = {seq.seq_id for seq in live_seqs}
    assert set(kv._locked_nodes) <= live_ids, "a finished sequence still holds a lock"
    assert set(kv._num_offered_blocks) <= live_ids, "insert record of a finished seq"
    for block_id in kv._quarantined:
        assert pool.refcount(block_id) > 0, f"quarantined block {block_id} is free"
        assert not pool.is_tree_owned(block_id), f"quarantined block {block_id} cached"
    assert all(node.num_own_locks > 0 for node in kv._locked_nodes.values())
    held = _references(kv, live_seqs)
    for block_id in range(pool.num_blocks):
        expected = held[block_id] + int(pool.is_tree_owned(block_id))
        actual = pool.refcount(block_id)
        assert actual == expected, (
            f"block {block_id}: refcount {actual} but {held[block_id]} sequence "
            f"reference(s) and tree-owned {pool.is_tree_owned(block_id)}"
        )


def _references(kv: KVCacheManager, live_seqs: list[Sequence]) -> Counter[int]:
    held: Counter[int] = Counter()
    for block_ids in kv._held.values():
        held.update(block_ids)
    for seq in live_seqs:
        assert len(set(seq.block_ids)) == len(seq.block_ids), (
            f"seq {seq.seq_id} lists a block twice: {seq.block_ids}"
        )
        held.update(seq.block_ids)
    return held
