"""KVCacheManager: block tables, copy-on-write on fork, the write check, integrity."""

from __future__ import annotations

import pytest

from engine.core.batch import BlockCopy
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager, WriteViolation

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE))


def make_seq(seq_id: int, num_prompt_tokens: int) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        choice_index=0,
        prompt_token_ids=list(range(num_prompt_tokens)),
        sampling_params=SamplingParams(),
        seed=0,
    )


def compute(manager: KVCacheManager, seq: Sequence, num_tokens: int) -> list[int]:
    """What the scheduler does for one chunk: slots, mapping, then the tokens are computed."""
    assert manager.allocate_slots(seq, num_tokens)
    slots = manager.slot_mapping(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    return slots


def fills(manager: KVCacheManager, seq: Sequence) -> list[int]:
    return [manager.pool.num_tokens(block_id) for block_id in seq.block_ids]


def test_allocate_slots_grows_the_table_one_block_at_a_time() -> None:
    manager = make_manager()
    seq = make_seq(0, 10)
    assert compute(manager, seq, 10) == list(range(10))
    assert seq.block_ids == [0, 1, 2]
    assert fills(manager, seq) == [4, 4, 2]
    assert compute(manager, seq, 1) == [10]
    assert compute(manager, seq, 1) == [11]
    assert seq.block_ids == [0, 1, 2]
    assert compute(manager, seq, 1) == [12]  # position 12 opens block 3
    assert seq.block_ids == [0, 1, 2, 3]
    assert fills(manager, seq) == [4, 4, 4, 1]
    assert manager.usage.fragmentation_ratio == 3 / 16


def test_slots_follow_the_block_table_not_the_position() -> None:
    manager = make_manager()
    other, seq = make_seq(0, 3), make_seq(1, 6)
    compute(manager, other, 3)  # takes block 0
    assert compute(manager, seq, 6) == [4, 5, 6, 7, 8, 9]  # blocks 1, 2
    manager.free(other)
    compute(manager, seq, 2)  # position 6, 7 still in block 2
    assert compute(manager, seq, 1) == [3 * BLOCK_SIZE]  # freed block 0 comes after 3..7


def test_allocate_slots_changes_nothing_when_the_pool_is_short() -> None:
    manager = make_manager(num_blocks=2)
    seq = make_seq(0, 9)
    assert not manager.allocate_slots(seq, 9)
    assert seq.block_ids == []
    assert manager.num_free_blocks == 2
    assert manager.allocate_slots(seq, 8)
    assert seq.block_ids == [0, 1]


def test_fork_shares_every_block_and_the_first_write_copies_the_partial_one() -> None:
    manager = make_manager()
    parent, child = make_seq(0, 6), make_seq(1, 6)
    compute(manager, parent, 6)  # blocks [0, 1]; block 1 holds 2 tokens
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    assert child.block_ids == [0, 1]
    assert [manager.pool.refcount(b) for b in (0, 1)] == [2, 2]
    manager.check_integrity([parent, child])

    assert compute(manager, child, 1) == [2 * BLOCK_SIZE + 2]  # into its private copy
    assert child.block_ids == [0, 2]
    assert manager.take_block_copies() == [BlockCopy(src=1, dst=2)]
    assert manager.take_block_copies() == []
    assert manager.num_cow_copies == 1
    assert [manager.pool.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert fills(manager, child) == [4, 3]

    # The parent is now the only holder of block 1: it writes in place, no copy.
    assert compute(manager, parent, 1) == [1 * BLOCK_SIZE + 2]
    assert parent.block_ids == [0, 1]
    assert manager.take_block_copies() == []
    assert manager.num_cow_copies == 1
    manager.check_integrity([parent, child])


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    manager = make_manager()
    parent, child = make_seq(0, 8), make_seq(1, 8)
    compute(manager, parent, 8)
    child.num_computed_tokens = 8
    manager.fork(parent, child)
    assert compute(manager, child, 1) == [2 * BLOCK_SIZE]
    assert compute(manager, parent, 1) == [3 * BLOCK_SIZE]
    assert manager.take_block_copies() == []
    assert manager.num_cow_copies == 0
    assert [manager.pool.refcount(b) for b in (0, 1)] == [2, 2]


def test_copy_on_write_needs_a_free_block() -> None:
    manager = make_manager(num_blocks=2)
    parent, child = make_seq(0, 6), make_seq(1, 6)
    compute(manager, parent, 6)
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    assert not manager.allocate_slots(child, 1)
    assert child.block_ids == [0, 1]
    assert manager.take_block_copies() == []


def test_slot_mapping_refuses_a_shared_block() -> None:
    manager = make_manager()
    parent, child = make_seq(0, 6), make_seq(1, 6)
    compute(manager, parent, 6)
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    with pytest.raises(WriteViolation, match=r"seq 1 would write block 1 \(refcount 2"):
        manager.slot_mapping(child, 1)  # allocate_slots skipped: no private copy


def test_slot_mapping_refuses_a_tree_owned_block() -> None:
    manager = make_manager()
    seq = make_seq(0, 6)
    compute(manager, seq, 6)
    manager.pool.set_tree_owned(1, True)
    with pytest.raises(WriteViolation, match=r"seq 0 would write block 1 .*tree-owned True"):
        manager.slot_mapping(seq, 1)


def test_tree_owned_block_is_copied_before_a_write_and_counted_in_integrity() -> None:
    manager = make_manager()
    seq = make_seq(0, 6)
    compute(manager, seq, 6)
    manager.pool.set_tree_owned(1, True)  # as the prefix tree will: it holds its own ref
    manager.pool.incref(1)
    assert compute(manager, seq, 1) == [2 * BLOCK_SIZE + 2]
    assert manager.take_block_copies() == [BlockCopy(src=1, dst=2)]
    assert manager.pool.refcount(1) == 1  # only the tree's reference is left
    manager.check_integrity([seq])
    assert manager.num_leaked_blocks([seq]) == 0


def test_slot_mapping_refuses_positions_past_the_table() -> None:
    manager = make_manager()
    seq = make_seq(0, 6)
    compute(manager, seq, 4)
    with pytest.raises(WriteViolation, match="beyond its block table"):
        manager.slot_mapping(seq, 2)


def test_free_is_idempotent_and_returns_every_block() -> None:
    manager = make_manager(num_blocks=4)
    parent, child = make_seq(0, 6), make_seq(1, 6)
    compute(manager, parent, 6)
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    manager.free(parent)
    assert [manager.pool.refcount(b) for b in (0, 1)] == [1, 1]
    manager.free(parent)
    manager.check_integrity([child])
    manager.free(child)
    assert manager.num_free_blocks == 4
    manager.check_integrity([])


def test_integrity_and_leak_count_see_a_forgotten_sequence() -> None:
    manager = make_manager()
    kept, forgotten = make_seq(0, 5), make_seq(1, 3)
    compute(manager, kept, 5)
    compute(manager, forgotten, 3)
    assert manager.num_leaked_blocks([kept, forgotten]) == 0
    assert manager.num_leaked_blocks([kept]) == 1
    with pytest.raises(AssertionError, match="block 2: refcount 1 but 0 sequence reference"):
        manager.check_integrity([kept])


def test_without_the_prefix_cache_admission_reuses_nothing_and_nothing_is_cached() -> None:
    manager = make_manager()
    assert manager.prefix_cache is None
    first = make_seq(0, 9)
    assert manager.admit(first, 100) == 9
    compute_admitted(manager, first, 9)
    manager.insert_prefix(first)
    assert not any(manager.pool.is_tree_owned(b) for b in range(8))
    manager.free(first)
    second = make_seq(1, 9)  # the same tokens
    assert manager.cached_prefix_len(second) == 0
    assert manager.admit(second, 4) == 4
    assert (second.block_ids, second.num_computed_tokens) == ([3], 0)  # oldest-freed last
    assert manager.evict(8) == [] and manager.num_evictions == 0


def compute_admitted(manager: KVCacheManager, seq: Sequence, num_tokens: int) -> list[int]:
    """The rest of a first chunk after admit(): slots, then the tokens are computed."""
    slots = manager.slot_mapping(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    return slots
