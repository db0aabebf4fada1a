"""What evict() may free and in which order, kept up to date as blocks change (torch-free).

The evictable count and the LRU heap of eviction candidates of a RadixCache are kept up to
date as blocks change state, so neither allocation nor a stats read walks the tree. A tree
block is pinned while someone besides the tree holds it (the pool reports each change); a
node is blocked while it has a pinned block, an own lock or a blocked child. evict() frees
the blocks after the last pinned one of every node without a lock and without a blocked
child, so that is the evictable count; a change walks up only while a node's blocked state
flips. RadixCache.check_integrity() (engine/kv/radix_integrity.py) recounts both from scratch.
"""

from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.namespace_quota import CandidateHeap, NamespaceQuota
from engine.kv.radix_node import RadixNode


class EvictionQueue:
    """The running figures of a RadixCache's nodes and its eviction candidates, LRU first.

    Contract: the cache reports every change that can alter a node's figures or make it a
    candidate: recount() after a node's block list changed, refresh() after its own locks
    changed, on_cached_change() with each report of the pool, on_split() and on_detach()
    after the tree changed shape, offer() after a new access time, a lock count back at 0 or
    a tail block evicted.
    It mutates only the figure fields of nodes (see RadixNode), never the tree. The quota is
    the cache's: the cache keeps its block counts, this queue its per-namespace heaps.
    """

    def __init__(self, pool: BlockPool, quota: NamespaceQuota) -> None:
        self._pool = pool
        self._quota = quota
        self.num_evictable_blocks = 0  # the sum of every node's num_evictable_blocks
        # Eviction candidates by (last_access, node_id); entries go stale when the node
        # changes and are skipped when popped (a lazy heap: no walk to rebuild it).
        self._heap = CandidateHeap()

    # -- running figures ----------------------------------------------------------------
    def on_cached_change(self, node: RadixNode, index: int, is_cached: bool) -> None:
        """Block `index` of node's edge became (or stopped being) held by the tree alone."""
        if not is_cached:
            node.last_pinned_index = max(node.last_pinned_index, index)
        elif index == node.last_pinned_index:
            # Holders hold paths from position 0, so the block before is pinned too when any
            # is: this scan stops at once but in transient states (never a walk of the tree).
            node.last_pinned_index = self._last_pinned_index(node, index - 1)
        self.refresh(node)
        if is_cached:
            self.offer(node)

    def _last_pinned_index(self, node: RadixNode, start: int) -> int:
        """The index of the last pinned block of node at or before `start` (-1: none)."""
        index = start
        while index >= 0 and self.is_held_by_tree_only(node.block_ids[index]):
            index -= 1
        return index

    def recount(self, node: RadixNode) -> None:
        """After node's block list changed: find its last pinned block again, then refresh."""
        node.last_pinned_index = self._last_pinned_index(node, len(node.block_ids) - 1)
        self.refresh(node)

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        """upper was cut from the top of lower's edge and took its place under the parent: it
        takes lower's place in the parent's blocked-children count too, then both recount."""
        upper.is_blocked = lower.is_blocked
        upper.num_blocked_children = int(lower.is_blocked)
        self.recount(lower)
        self.recount(upper)

    def on_detach(self, node: RadixNode, parent: RadixNode) -> None:
        """node was unhooked from parent: parent stops counting it and may be a leaf now."""
        if node.is_blocked:
            parent.num_blocked_children -= 1
            self.refresh(parent)
        self.offer(parent)

    def refresh(self, node: RadixNode | None) -> None:
        """Update node's evictable blocks and blocked state; go up while the state flips."""
        while node is not None and not node.is_root:
            is_covered = node.num_own_locks > 0 or node.num_blocked_children > 0
            num_unpinned = len(node.block_ids) - 1 - node.last_pinned_index
            num_evictable = 0 if is_covered else num_unpinned
            self.num_evictable_blocks += num_evictable - node.num_evictable_blocks
            node.num_evictable_blocks = num_evictable
            is_blocked = is_covered or node.last_pinned_index >= 0
            if is_blocked == node.is_blocked:
                return
            node.is_blocked = is_blocked
            if node.parent is not None:
                node.parent.num_blocked_children += 1 if is_blocked else -1
            node = node.parent

    # -- candidates ---------------------------------------------------------------------
    def offer(self, node: RadixNode | None) -> None:
        """Queue node for evict() if it is an eviction candidate now (duplicates are fine)."""
        if node is None or not self.is_candidate(node):
            return
        # Every tree-owned block of the pool is a tree block (one RadixCache per pool).
        self._heap.push(node, self._pool.num_tree_owned_blocks, self.is_current)
        self._quota.offer(node.namespace, node, self.is_current)

    def pop_victim(self) -> RadixNode | None:
        """The leaf to trim next: the LRU one of the namespaces over their cap, if any of
        them has one, else the LRU one of all (stale heap entries are skipped)."""
        node = self._quota.pop_over_cap(self.is_current) if self._quota.has_cap else None
        return node if node is not None else self._heap.pop(self.is_current)

    def is_current(self, last_access: int, node: RadixNode) -> bool:
        return last_access == node.last_access and self.is_candidate(node)

    def is_candidate(self, node: RadixNode) -> bool:
        """An attached, unlocked leaf whose tail block only the tree holds (a sequence that
        still holds it would lose nothing: evicting it frees no memory)."""
        return (
            not node.is_root
            and node.parent is not None
            and not node.children
            and node.lock_count == 0
            and bool(node.block_ids)
            and self.is_held_by_tree_only(node.block_ids[-1])
        )

    def is_held_by_tree_only(self, block_id: int) -> bool:
        return self._pool.refcount(block_id) == 1

    def queued_node_ids(self) -> set[int]:
        """The nodes with a current entry on the global heap, for check_integrity()."""
        return self._heap.queued_node_ids(self.is_current)

    def clear(self) -> None:
        """Drop every queued entry (after a reset all are stale); keeps no detached node alive."""
        self._heap.clear()
        self._quota.clear_heaps()
