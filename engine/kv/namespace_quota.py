"""Per-namespace accounting of the prefix tree: blocks held, a cap, eviction order (torch-free).

Every namespace (tenant, adapter, weights version: engine.core.sequence.make_namespace) counts
the tree blocks it holds. With a cap (engine config `max_cached_blocks_per_namespace`), a
namespace holding more than `cap` blocks is over it, and RadixCache.evict() takes the least
recently used evictable blocks of the namespaces over their cap before anyone else's: a tenant
that floods the cache with unique prompts evicts its own entries first, and another tenant's hot
prefix survives it. Once no namespace is over its cap (or has nothing evictable), eviction is
plain LRU over all namespaces; the cap never evicts on its own, so an idle pool stays full.

The counts change by one per block entering or leaving the tree, and a candidate is pushed
onto its namespace's heap as it is onto the global one (O(log n)): nothing here walks the tree.
RadixCache.check_integrity() recounts it all from the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Any

Namespace = Hashable
IsCurrent = Callable[[int, Any], bool]  # (queued last_access, node) -> entry still valid

_MIN_HEAP_TO_COMPACT = 64  # stale heap entries are dropped once they outnumber live ones


class CandidateHeap:
    """Eviction candidates by (last_access, node_id): a lazy min-heap.

    Entries go stale when their node changes (a new access time, a lock, a child, its tail
    block taken by a sequence, detached); they are skipped when they reach the top, and dropped
    in bulk once they outnumber the live blocks 4 to 1 (amortised over the pushes that made
    them). Nodes need `last_access` and `node_id`.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, Any]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: Any, num_live_blocks: int, is_current: IsCurrent) -> None:
        if len(self._entries) > max(_MIN_HEAP_TO_COMPACT, 4 * num_live_blocks):
            self._compact(is_current)
        heapq.heappush(self._entries, (node.last_access, node.node_id, node))

    def top(self, is_current: IsCurrent) -> tuple[int, int, Any] | None:
        """The least recently used current entry, left in place; stale ones above it go."""
        while self._entries:
            entry = self._entries[0]
            if is_current(entry[0], entry[2]):
                return entry
            heapq.heappop(self._entries)
        return None

    def pop(self, is_current: IsCurrent) -> Any | None:
        """Take the least recently used current candidate (None when there is none)."""
        entry = self.top(is_current)
        if entry is None:
            return None
        heapq.heappop(self._entries)
        return entry[2]

    def queued_node_ids(self, is_current: IsCurrent) -> set[int]:
        return {node.node_id for access, _, node in self._entries if is_current(access, node)}

    def clear(self) -> None:
        self._entries.clear()

    def _compact(self, is_current: IsCurrent) -> None:
        live = {n.node_id: (a, i, n) for a, i, n in self._entries if is_current(a, n)}
        self._entries = list(live.values())
        heapq.heapify(self._entries)


class NamespaceQuota:
    """Tree blocks per namespace and, with a cap, the namespaces over it and their candidates.

    The radix cache reports every block entering (add_blocks) and leaving (remove_block) the
    tree and offers every eviction candidate (offer); evict() asks pop_over_cap() first.
    max_blocks_per_namespace None: no cap (counts are still kept, heaps are not).
    """

    def __init__(self, max_blocks_per_namespace: int | None = None) -> None:
        assert max_blocks_per_namespace is None or max_blocks_per_namespace >= 1
        self.max_blocks = max_blocks_per_namespace
        self._num_blocks: dict[Namespace, int] = {}  # only namespaces holding blocks
        self._over_cap: dict[Namespace, None] = {}  # insertion-ordered set: deterministic
        self._heaps: dict[Namespace, CandidateHeap] = {}

    @property
    def has_cap(self) -> bool:
        return self.max_blocks is not None

    def num_blocks(self, namespace: Namespace) -> int:
        return self._num_blocks.get(namespace, 0)

    def namespaces_over_cap(self) -> list[Namespace]:
        return list(self._over_cap)

    def add_blocks(self, namespace: Namespace, num_blocks: int) -> None:
        count = self._num_blocks.get(namespace, 0) + num_blocks
        self._num_blocks[namespace] = count
        if self.max_blocks is not None and count > self.max_blocks:
            self._over_cap[namespace] = None

    def remove_block(self, namespace: Namespace) -> None:
        count = self._num_blocks[namespace] - 1
        if self.max_blocks is not None and count <= self.max_blocks:
            self._over_cap.pop(namespace, None)
        if count > 0:
            self._num_blocks[namespace] = count
            return
        del self._num_blocks[namespace]  # many tenants come and go: keep no empty entry
        self._heaps.pop(namespace, None)  # it holds no block, so every entry is stale

    def offer(self, namespace: Namespace, node: Any, is_current: IsCurrent) -> None:
        """Queue a node that is an eviction candidate now (only with a cap)."""
        if self.max_blocks is None:
            return
        heap = self._heaps.setdefault(namespace, CandidateHeap())
        heap.push(node, self._num_blocks.get(namespace, 0), is_current)

    def pop_over_cap(self, is_current: IsCurrent) -> Any | None:
        """Take the least recently used candidate among the namespaces over their cap, or None
        when none of them has one (their blocks are all in use or locked)."""
        best: tuple[int, int, Any] | None = None
        best_heap: CandidateHeap | None = None
        for namespace in self._over_cap:
            heap = self._heaps.get(namespace)
            entry = heap.top(is_current) if heap is not None else None
            if entry is not None and (best is None or entry[:2] < best[:2]):
                best, best_heap = entry, heap
        return None if best_heap is None else best_heap.pop(is_current)

    def clear_heaps(self) -> None:
        self._heaps.clear()

    def check(
        self,
        walked: dict[Namespace, int],
        candidates: list[tuple[Namespace, Any]],
        is_current: IsCurrent,
    ) -> None:
        """Raise AssertionError unless the counts equal `walked` (tree blocks per namespace,
        recounted from the tree), the over-cap set follows from them, and with a cap every
        candidate (namespace, node) is queued on its namespace's heap."""
        walked = {namespace: num for namespace, num in walked.items() if num}
        assert self._num_blocks == walked, f"blocks per namespace {self._num_blocks} != {walked}"
        cap = self.max_blocks
        expected_over = {ns for ns, num in walked.items() if cap is not None and num > cap}
        assert set(self._over_cap) == expected_over, "namespaces over the cap out of sync"
        if cap is None:
            assert not self._heaps, "heaps kept without a cap"
            return
        queued = {ns: heap.queued_node_ids(is_current) for ns, heap in self._heaps.items()}
        for namespace, node in candidates:
            assert node.node_id in queued.get(namespace, set()), (
                f"candidate {node.node_id} is not queued for its namespace"
            )
