"""BlockPool: allocation order, refcounts, free-list reuse, usage figures, integrity."""

from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool, BlockUsage, NoFreeBlocksError


def test_allocate_hands_out_ids_in_order_until_empty() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 0
    assert pool.num_used_blocks == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(num_blocks=0, block_size=4)


def test_incref_decref_walk_the_same_path() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    block_id = pool.allocate()
    assert pool.refcount(block_id) == 1
    assert pool.incref(block_id) == 2
    assert pool.incref(block_id) == 3
    assert pool.decref(block_id) == 2
    assert pool.decref(block_id) == 1
    assert pool.num_free_blocks == 1
    assert pool.decref(block_id) == 0
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="decref of free block 0"):
        pool.decref(block_id)
    with pytest.raises(AssertionError, match="incref of free block 0"):
        pool.incref(block_id)


def test_freed_blocks_are_reused_oldest_freed_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.decref(1)
    pool.decref(0)
    # Never-used block 3 was on the free list before 1 and 0.
    assert [pool.allocate() for _ in range(3)] == [3, 1, 0]


def test_writable_only_when_private_and_not_tree_owned() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    block_id = pool.allocate()
    assert pool.is_writable(block_id)
    pool.incref(block_id)
    assert not pool.is_writable(block_id)
    pool.decref(block_id)
    pool.set_tree_owned(block_id, True)
    assert pool.is_tree_owned(block_id)
    assert not pool.is_writable(block_id)


def test_usage_counts_states_fragmentation_and_watermark() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    private, shared, cached, spare = (pool.allocate() for _ in range(4))
    pool.incref(shared)
    pool.set_tree_owned(cached, True)
    pool.set_num_tokens(private, 1)
    pool.set_num_tokens(shared, 4)
    pool.set_num_tokens(cached, 4)
    pool.set_num_tokens(spare, 2)
    pool.decref(spare)  # peak stays at 4 used blocks
    assert pool.usage() == BlockUsage(
        num_total_blocks=5,
        num_free_blocks=2,
        num_private_blocks=1,
        num_shared_blocks=1,
        num_cached_blocks=1,
        fragmentation_ratio=(12 - 9) / 12,  # 3 used blocks, 9 of their 12 slots filled
        usage_watermark=4 / 5,
    )


def test_usage_of_an_empty_pool() -> None:
    usage = BlockPool(num_blocks=2, block_size=4).usage()
    assert (usage.num_free_blocks, usage.fragmentation_ratio, usage.usage_watermark) == (
        2,
        0.0,
        0.0,
    )


def test_fill_is_reset_when_a_block_is_freed_and_reallocated() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    block_id = pool.allocate()
    pool.set_num_tokens(block_id, 3)
    pool.decref(block_id)
    assert pool.num_tokens(block_id) == 0
    assert pool.allocate() == block_id
    assert pool.num_tokens(block_id) == 0
    with pytest.raises(AssertionError):
        pool.set_num_tokens(block_id, 5)


def test_tree_owned_block_cannot_be_freed() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    block_id = pool.allocate()
    pool.set_tree_owned(block_id, True)
    with pytest.raises(AssertionError, match="freed while tree-owned"):
        pool.decref(block_id)


def test_total_refcount_and_integrity() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    first, second = pool.allocate(), pool.allocate()
    pool.incref(first)
    pool.decref(second)
    assert pool.total_refcount() == 2
    pool.check_integrity()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda pool: pool._free_ids.append(2), "duplicate block on the free list"),
        (lambda pool: pool._refcounts.__setitem__(1, 1), "block 1: refcount 1 but on free list"),
        (lambda pool: pool._refcounts.__setitem__(0, 0), "block 0: refcount 0 but on free list"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_watermark_counts_blocks_held_by_sequences_not_cached_ones() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(), pool.allocate()  # two private blocks in use
    for block_id in (a, b):  # the tree takes them over, then the sequence lets go
        pool.incref(block_id)
        pool.set_tree_owned(block_id, True)
        pool.decref(block_id)
    assert pool.num_blocks_in_use == 0
    assert pool.usage().num_cached_blocks == 2
    pool.allocate()
    assert pool.usage().usage_watermark == 2 / 4  # the peak was the first two
    pool.incref(a)  # a request reuses cached block a: in use again
    pool.incref(b)
    assert pool.num_blocks_in_use == 3
    assert pool.usage().usage_watermark == 3 / 4
    pool.check_integrity()
