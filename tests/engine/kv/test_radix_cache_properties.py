"""Radix cache against a naive oracle, driven by hypothesis.

The oracle is, per namespace, a dict from each cached full-block prefix (a token tuple whose
length is a multiple of the block size) to the block id holding that prefix's last block.
Simulated sequences hold pool references the way the KV cache manager will: shared full
blocks from a match (incref), fresh private blocks for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_pool import BlockPool
from engine.kv.radix_cache import RadixCache
from engine.kv.radix_node import MatchResult, RadixNode

BS = 2
NAMESPACES = ("tenant-a", "tenant-b")
namespaces = st.sampled_from(NAMESPACES)
# A tiny alphabet makes shared prefixes and mid-block divergences common.
tokens_drawn = st.lists(st.integers(0, 2), max_size=9)
# How a prompt is made from one seen before: strict matching is tested where prompts are
# near misses (one token inserted, cut short, extended), not only where they are unrelated.
edits = st.sampled_from(["fresh", "same", "extend", "insert", "truncate"])

Oracle = dict[tuple[int, ...], int]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def oracle_match(oracle: Oracle, tokens: list[int], limit: int) -> tuple[list[int], int, set[int]]:
    """(full block ids, partial token count, the blocks that give that partial count)."""
    full: list[int] = []
    while (len(full) + 1) * BS <= limit and tuple(tokens[: (len(full) + 1) * BS]) in oracle:
        full.append(oracle[tuple(tokens[: (len(full) + 1) * BS])])
    start = len(full) * BS
    window = tokens[start:limit][:BS]
    best, candidates = 0, set()
    for key, block_id in oracle.items():
        if len(key) != start + BS or list(key[:start]) != tokens[:start]:
            continue
        n = common_prefix_len(key[start:], window)
        if n > best:
            best, candidates = n, {block_id}
        elif n == best and n > 0:
            candidates.add(block_id)
    return full, best, candidates


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=BS)
        self.cache = RadixCache(self.pool)
        self.oracles: dict[str, Oracle] = {ns: {} for ns in NAMESPACES}
        self.sequences: list[list[int]] = []  # the block references each sequence holds
        self.locks: list[RadixNode] = []
        self.history: list[list[int]] = []  # every prompt added so far

    # -- helpers --------------------------------------------------------------------------
    def checked_match(self, ns: str, tokens: list[int], limit: int) -> MatchResult:
        result = self.cache.match(ns, tokens, limit)
        full, num_partial, candidates = oracle_match(
            self.oracles[ns], tokens, min(limit, len(tokens))
        )
        assert list(result.full_block_ids) == full
        assert result.num_partial_tokens == num_partial
        if num_partial:
            assert result.partial_block_id in candidates
        else:
            assert result.partial_block_id is None
        assert result.num_matched_tokens == len(full) * BS + num_partial
        assert (result.last_node is None) == (result.num_matched_tokens == 0)
        return result

    def prompt(self, tokens: list[int], edit: str, index: int) -> list[int]:
        if edit == "fresh" or not self.history:
            return tokens
        seen = self.history[index % len(self.history)]
        if edit == "extend":
            return seen + tokens
        if edit == "insert":
            position = index % (len(seen) + 1)
            return seen[:position] + tokens[:1] + seen[position:]
        if edit == "truncate":
            return seen[: index % (len(seen) + 1)]
        return list(seen)

    def key_of(self, block_id: int) -> tuple[str, tuple[int, ...]]:
        for ns, oracle in self.oracles.items():
            for key, held in oracle.items():
                if held == block_id:
                    return ns, key
        raise AssertionError(f"block {block_id} is not in the oracle")

    def forget_evicted(self, freed: list[int]) -> None:
        for block_id in freed:  # in eviction order: each one must be a leaf by then
            ns, key = self.key_of(block_id)
            oracle = self.oracles[ns]
            assert not any(len(k) > len(key) and k[: len(key)] == key for k in oracle)
            del oracle[key]
            assert self.pool.refcount(block_id) == 0

    def make_room(self, num_blocks: int) -> None:
        missing = num_blocks - self.pool.num_free_blocks
        if missing > 0:
            self.forget_evicted(self.cache.evict(missing))

    # -- rules ----------------------------------------------------------------------------
    @rule(
        ns=namespaces,
        tokens=tokens_drawn,
        edit=edits,
        index=st.integers(0, 99),
        reuse=st.booleans(),
    )
    def add_sequence(self, ns: str, tokens: list[int], edit: str, index: int, reuse: bool) -> None:
        tokens = self.prompt(tokens, edit, index)
        self.history.append(tokens)
        shared: list[int] = []
        if reuse:
            shared = list(self.checked_match(ns, tokens, len(tokens) - 1).full_block_ids)
            for block_id in shared:
                self.pool.incref(block_id)
        num_full = len(tokens) // BS
        num_needed = -(-len(tokens) // BS) - len(shared)
        self.make_room(num_needed)
        if self.pool.num_free_blocks < num_needed:
            for block_id in shared:
                self.pool.decref(block_id)
            return
        blocks = shared + [self.pool.allocate() for _ in range(num_needed)]
        self.sequences.append(blocks)
        oracle = self.oracles[ns]
        new_keys = [tuple(tokens[: (i + 1) * BS]) for i in range(num_full)]
        new_keys = [k for k in new_keys if k not in oracle]
        assert self.cache.insert(ns, tokens[: num_full * BS], blocks[:num_full]) == len(new_keys)
        for key in new_keys:
            oracle[key] = blocks[len(key) // BS - 1]

    @precondition(lambda self: self.sequences)
    @rule(index=st.integers(0, 100))
    def finish_sequence(self, index: int) -> None:
        for block_id in self.sequences.pop(index % len(self.sequences)):
            self.pool.decref(block_id)

    @rule(ns=namespaces, tokens=tokens_drawn, edit=edits, index=st.integers(0, 99))
    def match(self, ns: str, tokens: list[int], edit: str, index: int) -> None:
        tokens = self.prompt(tokens, edit, index)
        self.checked_match(ns, tokens, len(tokens) - index % 3)

    @rule(ns=namespaces, tokens=tokens_drawn, edit=edits, index=st.integers(0, 99))
    def lock(self, ns: str, tokens: list[int], edit: str, index: int) -> None:
        tokens = self.prompt(tokens, edit, index)
        node = self.checked_match(ns, tokens, len(tokens)).last_node
        if node is not None:
            self.cache.lock(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        self.cache.unlock(self.locks.pop(index % len(self.locks)))

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        protected = set()
        for node in self.locks:
            walk: RadixNode | None = node
            while walk is not None:
                protected.update(walk.block_ids)
                walk = walk.parent
        expected = min(num_blocks, self.cache.num_evictable_blocks())
        freed = self.cache.evict(num_blocks)
        assert len(freed) == expected
        assert protected.isdisjoint(freed)
        self.forget_evicted(freed)

    @precondition(lambda self: self.cache.num_tree_blocks)
    @rule(index=st.integers(0, 100))
    def invalidate(self, index: int) -> None:
        tree_block_ids = self.cache.tree_block_ids()
        block_id = tree_block_ids[index % len(tree_block_ids)]
        ns, key = self.key_of(block_id)
        oracle = self.oracles[ns]
        below = {k for k in oracle if k[: len(key)] == key}
        assert sorted(self.cache.invalidate(block_id)) == sorted(oracle[k] for k in below)
        for k in below:
            del oracle[k]

    @rule(ns=namespaces, roll=st.integers(0, 3))
    def drop_namespace(self, ns: str, roll: int) -> None:
        if roll:  # mostly a no-op: dropping often would keep the trees too small to test
            return
        assert sorted(self.cache.drop_namespace(ns)) == sorted(self.oracles[ns].values())
        self.oracles[ns] = {}

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def tree_agrees_with_pool_and_oracle(self) -> None:
        self.cache.check_integrity()
        self.pool.check_integrity()
        held_by_sequences = sum(len(blocks) for blocks in self.sequences)
        assert self.pool.total_refcount() == held_by_sequences + self.cache.num_tree_blocks
        oracle_block_ids = [b for oracle in self.oracles.values() for b in oracle.values()]
        assert sorted(oracle_block_ids) == self.cache.tree_block_ids()
        assert not any(self.pool.is_writable(b) for b in oracle_block_ids)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
