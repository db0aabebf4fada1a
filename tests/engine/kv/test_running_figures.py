"""The KV figures cost the same for a pool of 1k blocks as for 100k (issue: stats pushed).

Counted in operations, not timed (benchmarks/stats_cost.py times them): the Python lines the
engine executes for a stats read and for an allocation that has to evict. A walk of the pool
or of the tree would run 100x more lines in the large pool.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler

ENGINE_DIR = str(Path(__file__).resolve().parents[3] / "engine")
BLOCK_SIZE = 4
NAMESPACE = make_namespace("w")


def lines_run(action: Callable[[], object]) -> int:
    """How many lines of engine/ code `action` executes (sys.settrace line events)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def enter(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(ENGINE_DIR) else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        action()
    finally:
        sys.settrace(previous)
    return count


def full_of_cached_blocks(num_blocks: int) -> tuple[KVCacheManager, Scheduler]:
    """Every block cached (held by the tree alone, one single-block prompt each): no free
    block is left, so an allocation must evict."""
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    kv = KVCacheManager(pool, enable_prefix_cache=True)
    assert kv.prefix_cache is not None
    for index in range(num_blocks):
        block_id = pool.allocate()
        kv.prefix_cache.insert(NAMESPACE, [index, 1, 2, 3], [block_id])
        pool.decref(block_id)  # the "sequence" that computed it is gone
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    return kv, scheduler


def new_sequence() -> Sequence:
    prompt = [-1, -2, -3, -4, -5]  # matches nothing cached
    return Sequence(0, "r", 0, prompt, SamplingParams(max_tokens=4), seed=0)


@pytest.mark.parametrize("what", ["stats", "allocation"])
def test_cost_does_not_grow_with_the_pool(what: str) -> None:
    counts = {}
    for num_blocks in (1_000, 100_000):
        kv, scheduler = full_of_cached_blocks(num_blocks)
        seq = new_sequence()
        if what == "stats":
            counts[num_blocks] = lines_run(scheduler.stats)
            stats = scheduler.stats()
            assert (stats.num_cached_blocks, stats.num_free_blocks) == (num_blocks, 0)
            assert stats.num_leaked_blocks == 0
        else:
            counts[num_blocks] = lines_run(lambda kv=kv, seq=seq: kv.allocate_slots(seq, 5))
            assert len(seq.block_ids) == 2 and kv.num_evictions == 2  # the LRU two went
            assert kv.usage.num_cached_blocks == num_blocks - 2
    assert counts[1_000] == counts[100_000] > 0, counts


def test_evictable_count_follows_holds_and_locks_without_a_walk() -> None:
    kv, _ = full_of_cached_blocks(1_000)
    assert kv.prefix_cache is not None
    cache, pool = kv.prefix_cache, kv.pool
    assert lines_run(cache.num_evictable_blocks) == 1  # a counter read, at any size
    assert cache.num_evictable_blocks() == 1_000
    match = cache.match(NAMESPACE, [7, 1, 2, 3, 9])
    pool.incref(match.full_block_ids[0])  # a sequence shares the cached block
    assert cache.num_evictable_blocks() == 999
    pool.decref(match.full_block_ids[0])
    assert match.last_node is not None
    cache.lock(match.last_node)
    assert cache.num_evictable_blocks() == 999
    cache.unlock(match.last_node)
    assert cache.num_evictable_blocks() == 1_000
    kv.check_integrity([])  # recounts every figure by walking, and compares


def test_pinning_a_long_edge_block_by_block_costs_the_same_per_block() -> None:
    """Taking (then dropping) every block of one cached edge in order, as _adopt_tree_blocks
    does, costs lines linear in the edge's length, a + b * n (no tail rescans: those grow as
    n * n)."""
    lines = {}
    for num_blocks in (10, 100, 1_000):
        pool = BlockPool(num_blocks, 1)
        kv = KVCacheManager(pool, enable_prefix_cache=True)
        assert kv.prefix_cache is not None
        block_ids = [pool.allocate() for _ in range(num_blocks)]
        kv.prefix_cache.insert(NAMESPACE, list(range(num_blocks)), block_ids)
        for block_id in block_ids:
            pool.decref(block_id)  # one edge, cached: the tree alone holds it

        def take_and_drop(block_ids=block_ids, pool=pool) -> None:
            for block_id in block_ids:
                pool.incref(block_id)
            for block_id in reversed(block_ids):
                pool.decref(block_id)

        lines[num_blocks] = lines_run(take_and_drop)
        kv.check_integrity([])
        assert kv.prefix_cache.num_evictable_blocks() == num_blocks
    assert lines[1_000] - lines[100] == 10 * (lines[100] - lines[10]), lines
