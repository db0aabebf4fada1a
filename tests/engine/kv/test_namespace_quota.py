"""The per-namespace cap on cached blocks: a flooding tenant evicts its own blocks first.

Exact block ids throughout (block_size 4; the pool hands out its lowest free ids first), the
same scenario with the cap off as the contrast, and check_integrity() after every scenario
(it recounts the blocks of every namespace and the namespaces over the cap from the tree).
"""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.radix_cache import RadixCache
from tests.engine.kv.radix_helpers import cached
from tests.engine.kv.test_running_figures import lines_run

BS = 4
A, B, C = (make_namespace("w", None, tenant) for tenant in ("tenant-a", "tenant-b", "tenant-c"))
PREFIX_A = list(range(1, 9))  # tenant A's two-block prompt


def one_block(tag: int) -> list[int]:
    """A unique one-block prompt (the flood)."""
    return [tag, tag + 1, tag + 2, tag + 3]


def make_cache(cap: int | None, num_blocks: int = 16) -> RadixCache:
    return RadixCache(BlockPool(num_blocks, BS), max_cached_blocks_per_namespace=cap)


def a_then_three_of_b(cache: RadixCache) -> None:
    assert cached(cache, PREFIX_A, A) == [0, 1]
    for block_id, tag in zip((2, 3, 4), (100, 200, 300), strict=True):
        assert cached(cache, one_block(tag), B) == [block_id]


@pytest.mark.parametrize(("cap", "first_victims"), [(2, [2]), (None, [1])])
def test_over_its_cap_a_namespace_loses_its_own_lru_block_first(cap, first_victims) -> None:
    cache = make_cache(cap)
    a_then_three_of_b(cache)  # A's blocks are the oldest: plain LRU takes A's tail block
    assert cache.namespaces_over_cap() == ([B] if cap else [])
    assert cache.evict(1) == first_victims
    cache.check_integrity()


def test_at_its_cap_eviction_is_plain_lru_again() -> None:
    cache = make_cache(2)
    a_then_three_of_b(cache)
    assert cache.evict(1) == [2]  # B: 3 -> 2 blocks, at its cap now
    assert cache.namespaces_over_cap() == []
    assert cache.evict(3) == [1, 0, 3]  # A's leaf (tail first), then B's oldest
    assert [cache.num_blocks_in_namespace(ns) for ns in (A, B)] == [0, 1]
    cache.check_integrity()


def test_one_evict_call_crosses_from_the_cap_to_lru() -> None:
    cache = make_cache(2)
    a_then_three_of_b(cache)
    assert cache.evict(2) == [2, 1]  # B's over-cap block, then global LRU: A's tail
    cache.check_integrity()


def test_a_flooding_tenant_cannot_evict_another_tenants_hot_prefix() -> None:
    def flood(cache: RadixCache) -> None:
        """B sends 12 unique prompts into a pool of 8 blocks, evicting when it is full."""
        for tag in range(100, 1300, 100):
            if cache.pool.num_free_blocks == 0:
                cache.evict(1)
            cached(cache, one_block(tag), B)

    for cap, expected in ((3, [0, 1]), (None, [])):
        cache = make_cache(cap, num_blocks=8)
        cached(cache, PREFIX_A, A)
        flood(cache)
        assert list(cache.match(A, PREFIX_A).full_block_ids) == expected
        cache.check_integrity()
    assert cache.num_blocks_in_namespace(B) == 8  # without the cap B took the whole pool


def test_an_over_cap_namespace_with_nothing_evictable_falls_back_to_lru() -> None:
    cache = make_cache(2)
    a_then_three_of_b(cache)
    for block_id in (2, 3, 4):  # a sequence holds each of B's blocks
        cache.pool.incref(block_id)
    assert cache.namespaces_over_cap() == [B]
    assert cache.evict(1) == [1]  # A's tail, the LRU evictable block
    cache.check_integrity()
    for block_id in (2, 3, 4):
        cache.pool.decref(block_id)
    assert cache.evict(1) == [2]  # B's blocks are evictable again: B first
    cache.check_integrity()


def test_a_lock_keeps_an_over_cap_namespace_from_being_evicted() -> None:
    cache = make_cache(2)
    a_then_three_of_b(cache)
    locked = [cache.match(B, one_block(tag)).last_node for tag in (100, 200, 300)]
    for node in locked:
        cache.lock(node)
    assert cache.evict(1) == [1]
    for node in locked:
        cache.unlock(node)
    assert cache.evict(1) == [2]  # match() refreshed all three in order: 100 is still LRU
    cache.check_integrity()


def test_of_two_namespaces_over_the_cap_the_least_recently_used_block_goes_first() -> None:
    cache = make_cache(1)
    assert cached(cache, one_block(900), C) == [0]  # the oldest block, but C is within its cap
    assert cached(cache, one_block(100), A) == [1]
    assert cached(cache, one_block(200), B) == [2]
    assert cached(cache, one_block(300), A) == [3]
    assert cached(cache, one_block(400), B) == [4]
    assert cache.namespaces_over_cap() == [A, B]
    assert cache.evict(2) == [1, 2]  # A's oldest, then B's oldest: both back at the cap
    assert cache.evict(1) == [0]  # then plain LRU: C's block
    cache.check_integrity()


def test_counts_follow_splits_invalidation_drops_and_reset() -> None:
    cache = make_cache(2)
    assert cached(cache, PREFIX_A, A) == [0, 1]
    assert cached(cache, [*PREFIX_A[:4], 50, 51, 52, 53, 54, 55, 56, 57], A) == [2, 3, 4]
    assert cache.num_blocks_in_namespace(A) == 4  # block 2 duplicated block 0: not taken
    assert cache.namespaces_over_cap() == [A]
    assert sorted(cache.invalidate(3)) == [3, 4]  # the split branch, from block 3 down
    assert (cache.num_blocks_in_namespace(A), cache.namespaces_over_cap()) == (2, [])
    assert cached(cache, one_block(100), B) == [5]  # 2, 3 and 4 went back behind 5..15
    assert sorted(cache.drop_namespace(A)) == [0, 1]
    assert [cache.num_blocks_in_namespace(ns) for ns in (A, B)] == [0, 1]
    cache.check_integrity()
    assert cache.reset() == [5]
    assert cache.num_blocks_in_namespace(B) == 0
    cache.check_integrity()


def test_without_the_cap_counts_are_kept_too() -> None:
    cache = make_cache(None)
    a_then_three_of_b(cache)
    assert [cache.num_blocks_in_namespace(ns) for ns in (A, B, C)] == [2, 3, 0]
    assert cache.namespaces_over_cap() == []
    cache.check_integrity()


# -- through the KV cache manager (what the scheduler calls) ------------------------------
def make_seq(seq_id: int, prompt: list[int], namespace) -> Sequence:
    return Sequence(
        seq_id, f"r{seq_id}", 0, prompt, SamplingParams(max_tokens=1), 0, cache_namespace=namespace
    )


def serve(manager: KVCacheManager, seq: Sequence) -> int:
    """Admit, compute the whole prompt in one chunk, cache it, finish; the cached tokens."""
    num_new_tokens = manager.admit(seq, token_budget=64)
    assert num_new_tokens is not None
    num_cached = seq.num_computed_tokens
    manager.take_block_copies()
    manager.slot_mapping(seq, num_new_tokens)
    seq.num_computed_tokens += num_new_tokens
    manager.insert_prefix(seq)
    manager.free(seq)
    manager.check_integrity([])
    return num_cached


@pytest.mark.parametrize(("cap", "num_b_blocks", "cached_after_flood"), [(4, 6, 12), (None, 9, 0)])
def test_manager_keeps_a_hot_prefix_through_a_flood(cap, num_b_blocks, cached_after_flood) -> None:
    manager = KVCacheManager(BlockPool(10, BS), True, max_cached_blocks_per_namespace=cap)
    hot = list(range(1, 14))  # 13 tokens: 3 full blocks cached, the 13th is computed
    assert serve(manager, make_seq(0, hot, A)) == 0
    assert serve(manager, make_seq(1, hot, A)) == 12
    for index in range(20):  # B: unique 9-token prompts, two full blocks each
        prompt = [1000 + 16 * index + t for t in range(9)]
        assert serve(manager, make_seq(2 + index, prompt, B)) == 0
    # With the cap, each B request evicts B's own blocks down to the cap, then caches its two
    # new ones (4 + 2); without it, B ends up with every block but the last request's private
    # one (10 - 1), A's evicted on the way.
    assert manager.num_cached_blocks_in(B) == num_b_blocks
    assert manager.num_cached_blocks_in(A) == (3 if cap else 0)
    assert serve(manager, make_seq(99, hot, A)) == cached_after_flood


@pytest.mark.parametrize("value", [0, -1])
def test_the_config_key_refuses_a_cap_below_one(value: int) -> None:
    with pytest.raises(ParamError, match="max_cached_blocks_per_namespace"):
        EngineConfig(max_cached_blocks_per_namespace=value)
    assert EngineConfig().max_cached_blocks_per_namespace is None


def test_capped_eviction_costs_the_same_for_1k_blocks_as_for_100k() -> None:
    """Counted in engine lines run (tests/engine/kv/test_running_figures.py), not timed."""
    counts = {}
    for num_blocks in (1_000, 100_000):
        manager = KVCacheManager(BlockPool(num_blocks, BS), True, max_cached_blocks_per_namespace=8)
        assert manager.prefix_cache is not None
        pool, cache = manager.pool, manager.prefix_cache
        for index in range(num_blocks):  # A's 4 oldest blocks, then B over its cap
            block_id = pool.allocate()
            cache.insert(A if index < 4 else B, one_block(4 * index), [block_id])
            pool.decref(block_id)  # the "sequence" that computed it is gone
        seq = make_seq(0, [-1] * 5, A)
        counts[num_blocks] = lines_run(lambda m=manager, s=seq: m.allocate_slots(s, 5))
        assert manager.num_cached_blocks_in(A) == 4  # B's two oldest went, not A's
        assert manager.num_cached_blocks_in(B) == num_blocks - 4 - 2
    assert counts[1_000] == counts[100_000] > 0, counts
