"""Radix cache: exact block ids, strict matching, LRU eviction, locks, invalidation."""

from __future__ import annotations

import pytest

from engine.core.sequence import make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.radix_cache import RadixCache
from engine.kv.radix_node import MatchResult
from tests.engine.kv.radix_helpers import NS, cached

BS = 4  # block_size: small so that block boundaries are easy to see
ZWSP = 8203  # a token id standing in for an invisible zero-width space


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=16, block_size=BS)


@pytest.fixture
def cache(pool: BlockPool) -> RadixCache:
    return RadixCache(pool)


def summary(result: MatchResult) -> tuple:
    return (
        list(result.full_block_ids),
        result.partial_block_id,
        result.num_partial_tokens,
        result.num_matched_tokens,
    )


def test_make_namespace_fills_missing_parts() -> None:
    assert make_namespace("w1") == ("w1", "", "")
    assert make_namespace("w1", "lora-a", "tenant-7") == ("w1", "lora-a", "tenant-7")


def test_match_on_empty_tree(cache: RadixCache) -> None:
    result = cache.match(NS, [1, 2, 3, 4, 5])
    assert summary(result) == ([], None, 0, 0)
    assert result.last_node is None
    assert cache.namespaces == []  # a lookup creates no root
    cached(cache, list(range(8)))
    assert summary(cache.match(NS, [])) == ([], None, 0, 0)
    assert summary(cache.match(NS, [99, 1, 2])) == ([], None, 0, 0)


def test_insert_takes_a_reference_and_marks_blocks_read_only(
    cache: RadixCache, pool: BlockPool
) -> None:
    a, b = pool.allocate(), pool.allocate()
    assert cache.insert(NS, list(range(8)), [a, b]) == 2
    assert [pool.refcount(a), pool.refcount(b)] == [2, 2]
    assert pool.is_tree_owned(a) and not pool.is_writable(b)
    assert cache.tree_block_ids() == [a, b] and cache.num_tree_blocks == 2
    cache.check_integrity()


def test_full_match(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    assert summary(cache.match(NS, [*range(8), 50, 51])) == ([a, b], None, 0, 8)
    assert summary(cache.match(NS, list(range(8)))) == ([a, b], None, 0, 8)


def test_partial_match_ends_mid_block(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    result = cache.match(NS, [0, 1, 2, 3, 4, 5, 99, 7])
    assert summary(result) == ([a], b, 2, 6)
    assert result.last_node is not None and result.last_node.block_ids == [a, b]
    # A prompt shorter than the cached run ends inside block b too.
    assert summary(cache.match(NS, [0, 1, 2, 3, 4])) == ([a], b, 1, 5)


def test_cap_leaves_the_last_prompt_token_to_compute(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    prompt = list(range(8))
    assert summary(cache.match(NS, prompt, len(prompt) - 1)) == ([a], b, 3, 7)
    assert summary(cache.match(NS, prompt[:5], 4)) == ([a], None, 0, 4)
    assert summary(cache.match(NS, prompt, 0)) == ([], None, 0, 0)


@pytest.mark.parametrize(
    ("position", "expected"),
    [
        (0, ([], None, 0, 0)),
        (3, ([], "a", 3, 3)),
        (4, (["a"], None, 0, 4)),  # exactly on a block boundary
        (5, (["a"], "b", 1, 5)),  # one token past it
        (7, (["a"], "b", 3, 7)),
    ],
)
def test_zero_width_space_stops_sharing_exactly_there(
    cache: RadixCache, position: int, expected: tuple
) -> None:
    a, b, _ = cached(cache, list(range(12)))
    ids = {"a": a, "b": b}
    prompt = list(range(12))
    prompt.insert(position, ZWSP)
    full, partial, num_partial, num_matched = expected
    want = ([ids[x] for x in full], ids.get(partial), num_partial, num_matched)
    assert summary(cache.match(NS, prompt)) == want


def test_identical_prompts_reuse_all_but_the_last_token(cache: RadixCache, pool: BlockPool) -> None:
    prompt = list(range(10))
    a, b = cached(cache, prompt)
    assert summary(cache.match(NS, prompt, len(prompt) - 1)) == ([a, b], None, 0, 8)
    # The second sequence computed its own copy of the same blocks: the tree keeps its own.
    c, d = pool.allocate(), pool.allocate()
    assert cache.insert(NS, prompt[:8], [c, d]) == 0
    assert [pool.refcount(c), pool.is_tree_owned(c)] == [1, False]
    assert cache.tree_block_ids() == [a, b]
    cache.check_integrity()


def test_prompts_identical_but_the_last_token(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    other = [*range(7), 70]
    assert summary(cache.match(NS, other, len(other) - 1)) == ([a], b, 3, 7)
    assert summary(cache.match(NS, other)) == ([a], b, 3, 7)
    longer = [*range(8), 8]  # the difference falls after the cached blocks
    assert summary(cache.match(NS, longer, len(longer) - 1)) == ([a, b], None, 0, 8)


def test_truncated_conversation_is_not_reused(cache: RadixCache) -> None:
    cached(cache, list(range(12)))
    assert summary(cache.match(NS, list(range(4, 16)))) == ([], None, 0, 0)


def test_namespaces_never_share(cache: RadixCache, pool: BlockPool) -> None:
    tenant_a, tenant_b = make_namespace("w1", None, "a"), make_namespace("w1", None, "b")
    a = cached(cache, list(range(8)), tenant_a)
    assert summary(cache.match(tenant_b, list(range(8)))) == ([], None, 0, 0)
    b = cached(cache, list(range(8)), tenant_b)
    assert set(a).isdisjoint(b)
    assert summary(cache.match(tenant_b, list(range(8)))) == (b, None, 0, 8)
    assert cache.drop_namespace(tenant_a) == a  # other weights loaded: the old cache goes
    assert [pool.refcount(x) for x in a] == [0, 0]
    assert summary(cache.match(tenant_a, list(range(8)))) == ([], None, 0, 0)
    assert summary(cache.match(tenant_b, list(range(8)))) == (b, None, 0, 8)
    assert cache.drop_namespace(tenant_a) == []
    cache.check_integrity()


def test_insert_extends_an_existing_prefix(cache: RadixCache, pool: BlockPool) -> None:
    a, b = cached(cache, list(range(8)))
    c, d, e = pool.allocate(), pool.allocate(), pool.allocate()
    assert cache.insert(NS, list(range(12)), [c, d, e]) == 1
    assert summary(cache.match(NS, list(range(12)))) == ([a, b, e], None, 0, 12)
    assert [pool.refcount(c), pool.refcount(e)] == [1, 2]
    cache.check_integrity()


def test_insert_splits_an_edge_at_a_block_boundary(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    c, d = cached(cache, [0, 1, 2, 3, 50, 51, 52, 53])
    assert cache.tree_block_ids() == sorted([a, b, d])
    assert c not in cache.tree_block_ids()  # freed: the sequence's duplicate of block a
    assert summary(cache.match(NS, list(range(8)))) == ([a, b], None, 0, 8)
    assert summary(cache.match(NS, [0, 1, 2, 3, 50, 51, 52, 53])) == ([a, d], None, 0, 8)


def test_sequences_diverging_inside_a_block_are_siblings(cache: RadixCache) -> None:
    (a,) = cached(cache, [0, 1, 2, 3])
    (b,) = cached(cache, [0, 1, 2, 9])
    assert summary(cache.match(NS, [0, 1, 2, 9])) == ([b], None, 0, 4)
    assert summary(cache.match(NS, [0, 1, 2, 3])) == ([a], None, 0, 4)
    assert summary(cache.match(NS, [0, 1, 7])) == ([], a, 2, 2)  # tie: first cached wins


def test_insert_rejects_mismatched_lengths(cache: RadixCache, pool: BlockPool) -> None:
    with pytest.raises(ValueError, match="len"):
        cache.insert(NS, [1, 2, 3], [pool.allocate()])


def test_lru_eviction_order(cache: RadixCache, pool: BlockPool) -> None:
    a1, a2 = cached(cache, list(range(8)))
    b1, b2 = cached(cache, list(range(100, 108)))
    (c1,) = cached(cache, list(range(200, 204)))
    cache.match(NS, list(range(8)))  # a is now the most recently used
    assert cache.num_evictable_blocks() == 5
    assert cache.evict(3) == [b2, b1, c1]
    assert cache.num_evictions == 3
    assert cache.evict(10) == [a2, a1]
    assert cache.num_evictions == 5 and cache.num_tree_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks
    cache.check_integrity()


def test_evicting_a_leaf_makes_its_parent_evictable(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    (c,) = cached(cache, [0, 1, 2, 3, 40, 41, 42, 43])[1:]
    cache.match(NS, list(range(8)))  # the b leaf is newer than the c leaf
    assert cache.evict(2) == [c, b]
    assert cache.evict(2) == [a]
    cache.check_integrity()


def test_locked_nodes_are_never_evicted(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    (c,) = cached(cache, list(range(100, 104)))
    node = cache.match(NS, [0, 1, 2, 3, 4, 99]).last_node  # ends mid-block b
    assert node is not None
    cache.lock(node)
    cache.lock(node)  # a second sequence on the same path
    assert cache.num_evictable_blocks() == 1
    assert cache.evict(10) == [c]
    cache.unlock(node)
    assert cache.evict(10) == []
    cache.unlock(node)
    with pytest.raises(AssertionError, match="unlock"):
        cache.unlock(node)
    assert cache.num_evictable_blocks() == 2
    assert cache.evict(10) == [b, a]
    cache.check_integrity()


def test_blocks_a_sequence_holds_are_not_evicted(cache: RadixCache, pool: BlockPool) -> None:
    a, b = pool.allocate(), pool.allocate()
    cache.insert(NS, list(range(8)), [a, b])  # the sequence still holds a and b
    assert cache.num_evictable_blocks() == 0
    assert cache.evict(2) == []
    pool.decref(b)  # the tail is the tree's alone now; a is still held
    assert cache.num_evictable_blocks() == 1
    assert cache.evict(2) == [b]
    assert cache.tree_block_ids() == [a]
    cache.check_integrity()


def test_lock_survives_a_split_of_the_locked_edge(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    node = cache.match(NS, list(range(8))).last_node
    assert node is not None
    cache.lock(node)
    cached(cache, [0, 1, 2, 3, 60, 61, 62, 63])  # splits the locked edge after block a
    assert node.block_ids == [b] and node.parent is not None
    assert node.parent.block_ids == [a] and node.parent.lock_count == 1
    cache.unlock(node)
    assert node.parent.lock_count == 0
    cache.check_integrity()


def test_invalidate_drops_the_subtree_and_spares_holders(
    cache: RadixCache, pool: BlockPool
) -> None:
    a, b = cached(cache, list(range(8)))
    (c,) = cached(cache, list(range(12)))[2:]
    (d,) = cached(cache, [*range(8), 20, 21, 22, 23])[2:]
    pool.incref(b)  # a running sequence shares b
    assert sorted(cache.invalidate(b)) == sorted([b, c, d])
    assert cache.num_invalidated_blocks == 3
    assert [pool.refcount(b), pool.is_tree_owned(b)] == [1, False]
    assert [pool.refcount(c), pool.refcount(d)] == [0, 0]
    assert summary(cache.match(NS, list(range(12)))) == ([a], None, 0, 4)
    cache.check_integrity()


def test_invalidate_inside_an_edge_keeps_earlier_blocks(cache: RadixCache) -> None:
    a, b, c = cached(cache, list(range(12)))
    assert cache.invalidate(b) == [b, c]
    assert summary(cache.match(NS, list(range(12)))) == ([a], None, 0, 4)
    cache.check_integrity()


def test_invalidate_a_block_the_tree_does_not_hold(cache: RadixCache, pool: BlockPool) -> None:
    (a,) = cached(cache, list(range(4)))
    assert cache.evict(1) == [a]
    assert cache.invalidate(a) == []
    private = pool.allocate()
    assert cache.invalidate(private) == []
    assert cache.num_invalidated_blocks == 0
    cache.check_integrity()


def test_invalidate_a_locked_node_then_unlock(cache: RadixCache) -> None:
    a, b = cached(cache, list(range(8)))
    node = cache.match(NS, list(range(8))).last_node
    assert node is not None
    cache.lock(node)
    assert cache.invalidate(b) == [b]
    assert node.parent is None  # detached: its lock no longer weighs on block a
    assert cache.evict(1) == [a]
    cache.unlock(node)
    cache.check_integrity()


def test_reset_releases_every_namespace(cache: RadixCache, pool: BlockPool) -> None:
    first = cached(cache, list(range(8)), make_namespace("w1"))
    second = cached(cache, list(range(8)), make_namespace("w2"))
    assert sorted(cache.reset()) == sorted(first + second)
    assert cache.namespaces == [] and cache.num_tree_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks
    cache.check_integrity()


def test_check_integrity_catches_a_block_the_pool_no_longer_marks(
    cache: RadixCache, pool: BlockPool
) -> None:
    a, _ = cached(cache, list(range(8)))
    pool.set_tree_owned(a, False)
    with pytest.raises(AssertionError, match="not tree-owned"):
        cache.check_integrity()


def test_check_integrity_catches_a_stray_tree_owned_block(
    cache: RadixCache, pool: BlockPool
) -> None:
    stray = pool.allocate()
    pool.set_tree_owned(stray, True)
    with pytest.raises(AssertionError, match="not in the tree"):
        cache.check_integrity()
