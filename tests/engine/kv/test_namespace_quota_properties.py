"""The per-namespace cap against an oracle of its own, driven by hypothesis.

The oracle knows which namespace inserted each block (the test's record of what the tree took)
and which blocks simulated sequences hold. For every evicted block it checks the rule: when a
namespace is over its cap and has a block only the tree holds, the block evicted belongs to
such a namespace. Sequences hold whole paths from position 0 (as the KV cache manager's do), so
a tree-only block always has an evictable leaf below it. check_integrity() (per-namespace
counts, the over-cap set and every queue) runs after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_pool import BlockPool
from engine.kv.radix_cache import RadixCache

BS = 2
CAP = 3
NUM_BLOCKS = 12
NAMESPACES = ("tenant-a", "tenant-b", "tenant-c")
namespaces = st.sampled_from(NAMESPACES)
prompts = st.lists(st.integers(0, 2), min_size=BS, max_size=4 * BS)


class CappedCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.cache = RadixCache(self.pool, max_cached_blocks_per_namespace=CAP)
        self.namespace_of: dict[int, str] = {}  # tree block -> the namespace that inserted it
        self.holds: list[list[int]] = []  # block lists held by simulated sequences

    def tree_blocks(self, namespace: str) -> list[int]:
        return [b for b, ns in self.namespace_of.items() if ns == namespace]

    @rule(namespace=namespaces, tokens=prompts)
    def insert(self, namespace: str, tokens: list[int]) -> None:
        num_blocks = len(tokens) // BS
        while self.pool.num_free_blocks < num_blocks:
            if not self.evict_one():
                return  # everything is held: the request would wait
        block_ids = [self.pool.allocate() for _ in range(num_blocks)]
        num_taken = self.cache.insert(namespace, tokens[: num_blocks * BS], block_ids)
        for block_id in block_ids[num_blocks - num_taken :]:  # the tree takes the new tail
            self.namespace_of[block_id] = namespace
        for block_id in block_ids:
            self.pool.decref(block_id)

    @rule(namespace=namespaces, tokens=prompts)
    def hold(self, namespace: str, tokens: list[int]) -> None:
        """A sequence reuses the cached full blocks of its prompt."""
        match = self.cache.match(namespace, tokens)
        for block_id in match.full_block_ids:
            self.pool.incref(block_id)
        self.holds.append(list(match.full_block_ids))

    @precondition(lambda self: self.holds)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        for block_id in self.holds.pop(index % len(self.holds)):
            self.pool.decref(block_id)

    @rule()
    def evict(self) -> None:
        self.evict_one()

    def evict_one(self) -> bool:
        counts = {ns: len(self.tree_blocks(ns)) for ns in NAMESPACES}
        over = [ns for ns in NAMESPACES if counts[ns] > CAP]
        over_with_free = {
            ns for ns in over if any(self.pool.refcount(b) == 1 for b in self.tree_blocks(ns))
        }
        any_free = any(self.pool.refcount(b) == 1 for b in self.namespace_of)
        freed = self.cache.evict(1)
        assert len(freed) == int(any_free), f"freed {freed} with a tree-only block: {any_free}"
        for block_id in freed:
            namespace = self.namespace_of.pop(block_id)
            assert not over_with_free or namespace in over_with_free, (
                f"evicted {block_id} of {namespace} while {over_with_free} were over the cap"
            )
        return bool(freed)

    @invariant()
    def figures_agree(self) -> None:
        self.cache.check_integrity()
        assert sorted(self.namespace_of) == self.cache.tree_block_ids()
        for namespace in NAMESPACES:
            num_blocks = len(self.tree_blocks(namespace))
            assert self.cache.num_blocks_in_namespace(namespace) == num_blocks
            assert (namespace in self.cache.namespaces_over_cap()) == (num_blocks > CAP)


TestCappedCache = CappedCacheMachine.TestCase
TestCappedCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
