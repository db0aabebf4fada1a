"""KV events of the radix cache: chained block hashes, the events of each tree change, and
nothing at all without a sink. Only engine/kv objects (no zmq, no model)."""

from __future__ import annotations

import random

import pytest

import engine.kv.kv_events as kv_events
from engine.core.errors import KVEventsDisabled
from engine.core.sequence import make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    chain_block_hashes,
    hash_block,
    namespace_seed,
)
from engine.kv.radix_cache import RadixCache
from tests.engine.kv.radix_helpers import NS, cached

BS = 4
TENANT = make_namespace("w1", cache_salt="tenant-7")


@pytest.fixture
def events() -> list[KVEvent]:
    return []


@pytest.fixture
def cache(events: list[KVEvent]) -> RadixCache:
    return RadixCache(BlockPool(num_blocks=16, block_size=BS), event_sink=events.append)


def chain(tokens: list[int], namespace=NS) -> list[int]:
    return chain_block_hashes(namespace_seed(namespace), tokens, BS)


def apply(events: list[KVEvent], held: set[int] | None = None) -> set[int]:
    """What a subscriber holds after applying events in order."""
    held = set() if held is None else held
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in held
            assert not held & set(event.block_hashes), "a block stored twice"
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= held, "a block removed that was never stored"
            held.difference_update(event.block_hashes)
        else:
            held.clear()
    return held


# -- hashing ------------------------------------------------------------------------------


def test_namespaces_fold_into_the_first_hash() -> None:
    tokens = list(range(8))
    assert chain(tokens, NS) != chain(tokens, TENANT)
    assert not set(chain(tokens, NS)) & set(chain(tokens, TENANT))
    assert namespace_seed(("ab", "c")) != namespace_seed(("a", "bc"))
    assert chain(tokens, make_namespace("w2")) != chain(tokens, NS)


def test_a_block_hash_depends_on_its_whole_prefix() -> None:
    a = chain([1, 2, 3, 4, 9, 9, 9, 9])
    b = chain([1, 2, 3, 5, 9, 9, 9, 9])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other first block
    assert chain([1, 2, 3, 4]) == a[:1]  # a prefix's hashes are the longer chain's
    assert a[1] == hash_block(a[0], [9, 9, 9, 9])


def test_hashes_are_stable_unsigned_64_bit() -> None:
    hashes = chain(list(range(16)))
    assert hashes == chain(list(range(16)))
    assert all(0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == 4


# -- events of tree changes -----------------------------------------------------------------


def test_insert_stores_only_the_new_blocks_with_their_parent(
    cache: RadixCache, events: list[KVEvent]
) -> None:
    cached(cache, list(range(8)))
    cached(cache, [*range(8), 20, 21, 22, 23, 24])  # one new full block (the 24 is partial)
    cached(cache, list(range(8)))  # nothing new: no event
    h = chain([*range(8), 20, 21, 22, 23])
    assert events == [
        BlockStored((h[0], h[1]), None, tuple(range(8)), BS),
        BlockStored((h[2],), h[1], (20, 21, 22, 23), BS),
    ]


def test_insert_below_a_split_names_the_upper_block_as_parent(
    cache: RadixCache, events: list[KVEvent]
) -> None:
    cached(cache, list(range(12)))
    cached(cache, [0, 1, 2, 3, 7, 7, 7, 7])  # splits the edge after its first block
    h = chain(list(range(12)))
    assert events[1] == BlockStored((chain([0, 1, 2, 3, 7, 7, 7, 7])[1],), h[0], (7,) * 4, BS)
    assert apply(events) == set(cache.block_hashes().values())


def test_evict_removes_the_hashes_of_the_freed_blocks(
    cache: RadixCache, events: list[KVEvent]
) -> None:
    cached(cache, list(range(12)))
    events.clear()
    assert len(cache.evict(2)) == 2
    h = chain(list(range(12)))
    assert events == [BlockRemoved((h[2], h[1]))]  # tail blocks first, one event per call
    cache.evict(0)
    assert len(events) == 1  # nothing freed: no event


def test_invalidate_removes_the_block_and_everything_after_it(
    cache: RadixCache, events: list[KVEvent]
) -> None:
    a, b, c = cached(cache, list(range(12)))
    (d,) = cached(cache, [*range(8), 20, 21, 22, 23])[2:]
    events.clear()
    assert sorted(cache.invalidate(b)) == sorted([b, c, d])
    h, other = chain(list(range(12))), chain([*range(8), 20, 21, 22, 23])
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)
    assert sorted(events[0].block_hashes) == sorted([h[1], h[2], other[2]])
    assert cache.block_hashes() == {a: h[0]}
    cache.invalidate(c)  # already gone: no event
    assert len(events) == 1


def test_drop_namespace_and_reset(cache: RadixCache, events: list[KVEvent]) -> None:
    cached(cache, list(range(8)), NS)
    cached(cache, list(range(8)), TENANT)
    events.clear()
    cache.drop_namespace(TENANT)
    assert events == [BlockRemoved(tuple(chain(list(range(8)), TENANT)))]
    cache.reset()
    assert events[1:] == [AllBlocksCleared()]
    assert cache.block_hashes() == {}
    cache.check_integrity()


def test_a_subscriber_rebuilds_the_cache_through_random_changes(
    cache: RadixCache, events: list[KVEvent]
) -> None:
    rng = random.Random(7)
    held: set[int] = set()
    for step in range(300):
        op = rng.random()
        namespace = rng.choice([NS, TENANT])
        if op < 0.55:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 4) * BS)]
            if cache.pool.num_free_blocks < len(tokens) // BS:
                cache.evict(len(tokens) // BS)
            if cache.pool.num_free_blocks >= len(tokens) // BS:
                cached(cache, tokens, namespace)
        elif op < 0.8:
            cache.evict(rng.randrange(1, 4))
        elif op < 0.95 and cache.tree_block_ids():
            cache.invalidate(rng.choice(cache.tree_block_ids()))
        elif op < 0.98:
            cache.drop_namespace(namespace)
        else:
            cache.reset()
        apply(events, held)
        events.clear()
        assert held == set(cache.block_hashes().values()), f"step {step}"
        cache.check_integrity()  # also: the recorded hashes equal a recompute


def test_the_manager_lists_hashes_and_quarantine_removes_them() -> None:
    events: list[KVEvent] = []
    manager = KVCacheManager(
        BlockPool(16, BS), enable_prefix_cache=True, kv_event_sink=events.append
    )
    cache = manager.prefix_cache
    assert cache is not None
    _, b, c = cached(cache, list(range(12)))
    assert manager.cached_block_hashes() == sorted(chain(list(range(12))))
    assert sorted(manager.quarantine([b])) == sorted([b, c])
    assert apply(events) == set(manager.cached_block_hashes()) == {chain([0, 1, 2, 3])[0]}
    manager.check_integrity([])


# -- off by default -------------------------------------------------------------------------


def test_without_a_sink_the_cache_hashes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_hash = kv_events.hash_block

    def counting_hash(parent: int, token_ids: list[int]) -> int:
        calls.append(parent)
        return real_hash(parent, token_ids)

    monkeypatch.setattr(kv_events, "hash_block", counting_hash)
    quiet = RadixCache(BlockPool(num_blocks=16, block_size=BS))
    for tokens in (list(range(12)), [*range(8), 5, 5, 5, 5], list(range(4))):
        cached(quiet, tokens)
    quiet.evict(2)
    quiet.invalidate(quiet.tree_block_ids()[0])
    quiet.reset()
    assert calls == []
    assert not quiet.is_recording_events
    manager = KVCacheManager(BlockPool(16, BS), enable_prefix_cache=True)
    with pytest.raises(KVEventsDisabled):
        manager.cached_block_hashes()

    recording = RadixCache(BlockPool(num_blocks=16, block_size=BS), event_sink=[].append)
    cached(recording, list(range(12)))
    assert len(calls) >= 3  # the counter sees hashing when there is a sink
