"""Radix tree over token ids -> KV block ids: the prefix cache (torch-free).

The tree stores KV at block granularity. Every edge covers a whole number of blocks
(len(token_ids) == len(block_ids) * block_size), so a node can be split only at a block
boundary and every block the tree owns is full. Children are keyed by the token ids of the
first block of their edge: two sequences that diverge inside a block are two siblings, and
each keeps its own cached block.

References: the tree holds exactly one pool reference to every block it owns (incref on
insert, decref on evict / invalidate / drop) and marks it `set_tree_owned(True)` for as long
as it holds it. Sequences hold their own references; the tree never touches those. One
RadixCache per BlockPool (tree ownership in the pool is one flag per block); not
thread-safe: the engine thread is the only caller.

Namespaces: one root per namespace key (engine.core.sequence.make_namespace). Nothing is
ever shared across roots, so two tenants, adapters or weight versions never see each other's
KV. With max_cached_blocks_per_namespace, a namespace holding more tree blocks than that is
over its cap and evict() takes its least recently used blocks before anyone else's
(engine/kv/namespace_quota.py keeps the per-namespace counts and heaps).

Running figures. The evictable count and the LRU heap of eviction candidates are kept up to
date as blocks change state, so neither allocation nor a stats read walks the tree. A tree
block is pinned while someone besides the tree holds it (the pool reports each change); a
node is blocked while it has a pinned block, an own lock or a blocked child. evict() frees
the blocks after the last pinned one of every node without a lock and without a blocked
child, so that is the evictable count; a change walks up only while a node's blocked state
flips. check_integrity() recounts both from scratch.

KV events (engine/kv/kv_events.py): built with an event_sink, the cache hashes every block it
takes and reports BlockStored on insert, BlockRemoved on evict / invalidate / drop_namespace
(one event per call) and AllBlocksCleared on reset. Without a sink (the default) it hashes
nothing and reports nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

from engine.kv.block_pool import BlockPool
from engine.kv.kv_events import KVEventRecorder, KVEventSink, chain_block_hashes, namespace_seed
from engine.kv.namespace_quota import CandidateHeap, NamespaceQuota

Namespace = Hashable

_node_ids = count()


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree. Callers treat it as an opaque handle for lock()/unlock().

    lock_count counts the locks taken on this node and on every node below it:
    lock_count == num_own_locks + sum(child.lock_count for child in children).
    """

    token_ids: tuple[int, ...]
    block_ids: list[int]
    parent: RadixNode | None
    is_root: bool = False
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_count: int = 0
    num_own_locks: int = 0
    last_access: int = 0
    # Running figures (see the module docstring): the index of this edge's last pinned
    # block (-1: none), children that are blocked, whether this node is blocked, and how many
    # of its blocks evict() can free (those after the last pinned one).
    last_pinned_index: int = -1
    num_blocked_children: int = 0
    is_blocked: bool = False
    num_evictable_blocks: int = 0
    namespace: Namespace = None  # the namespace of the tree the node belongs to
    node_id: int = field(default_factory=lambda: next(_node_ids))


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a token sequence.

    full_block_ids: blocks whose block_size tokens all match, in order from position 0.
        The caller shares them: pool.incref() each one and list it in the block table.
    partial_block_id / num_partial_tokens: when the match ends inside a block, that block
        and how many of its leading tokens match (1..block_size-1); None / 0 otherwise.
        The caller must never write it nor list it in a block table: it copies those tokens'
        KV into a fresh private block (copy-on-write) and continues the sequence there.
    last_node: the deepest node the match touched (it holds the partial block when there
        is one), or None when nothing matched. lock(last_node) protects every matched block,
        the partial one included, from evict() until the matching unlock(last_node).
    """

    full_block_ids: tuple[int, ...]
    partial_block_id: int | None
    num_partial_tokens: int
    num_matched_tokens: int
    last_node: RadixNode | None


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    diffs = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(diffs, min(len(a), len(b)))


class RadixCache:
    """Prefix cache over a BlockPool; one tree per namespace.

    Mutations: match() changes only access times; insert() takes references, may split
    edges; evict(), invalidate(), drop_namespace() and reset() drop references. Locks are
    counted, so several sequences may lock the same path; each lock() needs one unlock().

    Intended use by the KV cache manager, on the engine thread:
      admit    r = match(ns, prompt, len(prompt) - 1); lock(r.last_node); incref each of
               r.full_block_ids; copy r.num_partial_tokens tokens of r.partial_block_id
               into a fresh private block (copy-on-write).
      compute  after each prefill chunk and at finish: insert(ns, tokens, full block ids).
      release  decref the sequence's blocks; unlock(r.last_node).
      pressure evict(n): frees only blocks that no sequence holds and no lock covers.
    """

    def __init__(
        self,
        pool: BlockPool,
        event_sink: KVEventSink | None = None,
        max_cached_blocks_per_namespace: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._events = None if event_sink is None else KVEventRecorder(event_sink, self.block_size)
        self._roots: dict[Namespace, RadixNode] = {}
        self._node_of_block: dict[int, RadixNode] = {}
        self._index_of_block: dict[int, int] = {}  # block -> its index in its node's edge
        self._clock = 0  # monotonic access counter: LRU order is deterministic
        self.num_evictions = 0  # blocks freed by evict()
        self.num_invalidated_blocks = 0  # blocks dropped by invalidate()
        self._num_evictable = 0  # the sum of every node's num_evictable_blocks
        # Eviction candidates by (last_access, node_id); entries go stale when the node
        # changes and are skipped when popped (a lazy heap: no walk to rebuild it).
        self._heap = CandidateHeap()
        self._quota = NamespaceQuota(max_cached_blocks_per_namespace)
        pool.set_cached_listener(self._on_cached_change)

    # -- lookup -------------------------------------------------------------------------
    def match(
        self, namespace: Namespace, token_ids: Sequence[int], max_num_tokens: int | None = None
    ) -> MatchResult:
        """Longest cached prefix of token_ids, compared token by token from position 0.

        At most max_num_tokens tokens are matched (pass len(prompt) - 1 so that at least
        one prompt token is left to compute and yields logits). Takes no references: the
        caller increfs the full blocks it uses, and locks last_node before calling
        evict() or insert() if it needs the partial block to survive until its copy.
        """
        root = self._roots.get(namespace)
        limit = len(token_ids) if max_num_tokens is None else min(len(token_ids), max_num_tokens)
        self._clock += 1
        if root is None or limit <= 0:
            return self._result([], None, 0, None)
        bs = self.block_size
        node, block_index, pos = root, 0, 0
        full_block_ids: list[int] = []
        last_node: RadixNode | None = None
        while pos < limit:
            window = token_ids[pos : min(pos + bs, limit)]
            if block_index == len(node.block_ids):
                child = self._best_child(node, window)
                if child is None:
                    break
                node, block_index = child, 0
            start = block_index * bs
            num_matching = _common_prefix_len(node.token_ids[start : start + bs], window)
            if num_matching == 0:
                break
            last_node = node
            if num_matching < bs:
                return self._result(full_block_ids, node.block_ids[block_index], num_matching, node)
            full_block_ids.append(node.block_ids[block_index])
            block_index += 1
            pos += bs
        return self._result(full_block_ids, None, 0, last_node)

    def _result(
        self, full: list[int], partial: int | None, num_partial: int, last: RadixNode | None
    ) -> MatchResult:
        self._touch_path(last)
        num_matched_tokens = len(full) * self.block_size + num_partial
        return MatchResult(tuple(full), partial, num_partial, num_matched_tokens, last)

    def _best_child(self, node: RadixNode, window: Sequence[int]) -> RadixNode | None:
        """The child sharing the longest prefix with window (>= 1 token), or None."""
        if len(window) == self.block_size:
            exact = node.children.get(tuple(window))
            if exact is not None:
                return exact
        best, best_len = None, 0
        for child in node.children.values():  # insertion order: ties resolve the same way
            n = _common_prefix_len(child.token_ids[: self.block_size], window)
            if n > best_len:
                best, best_len = child, n
        return best

    def _touch_path(self, node: RadixNode | None) -> None:
        deepest = node  # only it can be a leaf: offered again under its new LRU time
        while node is not None and not node.is_root:
            node.last_access = self._clock
            node = node.parent
        self._offer(deepest)

    # -- insertion ----------------------------------------------------------------------
    def insert(
        self, namespace: Namespace, token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> int:
        """Cache a sequence's full blocks; returns how many blocks the tree took over.

        token_ids are the sequence's tokens from position 0 covered by full blocks
        (len == len(block_ids) * block_size); block_ids[i] holds the KV of block i. Where
        the tree already has a block for the same tokens, it keeps its own and the
        sequence's block stays private to the sequence. Where the tokens are new, the tree
        increfs the sequence's block and marks it tree-owned (so it becomes read-only).
        The caller keeps its own references either way. Never pass blocks returned by
        invalidate(): they would be cached again.
        """
        bs = self.block_size
        if len(token_ids) != len(block_ids) * bs:
            raise ValueError(
                f"insert needs len(token_ids) == {bs} * len(block_ids), "
                f"got {len(token_ids)} tokens for {len(block_ids)} blocks"
            )
        self._clock += 1
        node = self._roots.get(namespace) or self._new_root(namespace)
        index = 0
        while index < len(block_ids):
            child = node.children.get(tuple(token_ids[index * bs : (index + 1) * bs]))
            if child is None:
                self._add_leaf(node, token_ids[index * bs :], block_ids[index:])
                if self._events is not None:
                    parent_block_id = None if node.is_root else node.block_ids[-1]
                    self._events.stored(
                        namespace, parent_block_id, token_ids[index * bs :], block_ids[index:]
                    )
                return len(block_ids) - index
            num_blocks = _common_prefix_len(child.token_ids, token_ids[index * bs :]) // bs
            index += num_blocks
            if num_blocks < len(child.block_ids) and index < len(block_ids):
                child = self._split(child, num_blocks)
            child.last_access = self._clock
            self._offer(child)
            node = child
        return 0

    def _new_root(self, namespace: Namespace) -> RadixNode:
        root = RadixNode((), [], None, is_root=True, namespace=namespace)
        self._roots[namespace] = root
        return root

    def _add_leaf(
        self, parent: RadixNode, token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        assert len(set(block_ids)) == len(block_ids), f"block listed twice: {list(block_ids)}"
        leaf = RadixNode(
            tuple(token_ids),
            list(block_ids),
            parent,
            last_access=self._clock,
            namespace=parent.namespace,
        )
        self._quota.add_blocks(parent.namespace, len(block_ids))
        parent.children[leaf.token_ids[: self.block_size]] = leaf
        for index, block_id in enumerate(block_ids):
            assert not self.pool.is_tree_owned(block_id), f"block {block_id} is already cached"
            self.pool.incref(block_id)
            self.pool.set_tree_owned(block_id, True)
            self._node_of_block[block_id] = leaf
            self._index_of_block[block_id] = index
        self._recount(leaf)

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut node's edge after num_blocks blocks; returns the new upper node.

        The original object stays the lower part, so lock holders keep a node whose
        parent chain (now through the upper node) still carries their lock.
        """
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < num_blocks < len(node.block_ids)
        upper = RadixNode(
            node.token_ids[: num_blocks * bs],
            node.block_ids[:num_blocks],
            parent,
            lock_count=node.lock_count,
            last_access=node.last_access,
            namespace=node.namespace,
        )
        parent.children[upper.token_ids[:bs]] = upper
        node.token_ids = node.token_ids[num_blocks * bs :]
        node.block_ids = node.block_ids[num_blocks:]
        node.parent = upper
        upper.children[node.token_ids[:bs]] = node
        for block_id in upper.block_ids:
            self._node_of_block[block_id] = upper
        for index, block_id in enumerate(node.block_ids):
            self._index_of_block[block_id] = index
        # upper takes node's place in parent's blocked-children count, then both recount.
        upper.is_blocked = node.is_blocked
        upper.num_blocked_children = int(node.is_blocked)
        self._recount(node)
        self._recount(upper)
        return upper

    # -- locking ------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Protect node and all its ancestors from evict(); one unlock(node) undoes it."""
        node.num_own_locks += 1
        self._add_lock_count(node, 1)
        self._refresh(node)

    def unlock(self, node: RadixNode) -> None:
        assert node.num_own_locks > 0, "unlock without a matching lock"
        node.num_own_locks -= 1
        self._add_lock_count(node, -1)
        self._refresh(node)

    def _add_lock_count(self, node: RadixNode | None, delta: int) -> None:
        # Stops at a root, or at the top of a detached subtree (parent None).
        while node is not None and not node.is_root:
            node.lock_count += delta
            assert node.lock_count >= 0
            if node.lock_count == 0:
                self._offer(node)  # unlocked: it may be an eviction candidate again
            node = node.parent

    # -- running figures ----------------------------------------------------------------
    def _on_cached_change(self, block_id: int, is_cached: bool) -> None:
        """The pool's report: a tree block became (or stopped being) held by the tree alone.
        Blocks entering or leaving the tree are not indexed then: their node recounts."""
        node = self._node_of_block.get(block_id)
        if node is None:
            return
        index = self._index_of_block[block_id]
        if not is_cached:
            node.last_pinned_index = max(node.last_pinned_index, index)
        elif index == node.last_pinned_index:
            # Holders hold paths from position 0, so the block before is pinned too when any
            # is: this scan stops at once but in transient states (never a walk of the tree).
            node.last_pinned_index = self._last_pinned_index(node, index - 1)
        self._refresh(node)
        if is_cached:
            self._offer(node)

    def _last_pinned_index(self, node: RadixNode, start: int) -> int:
        """The index of the last pinned block of node at or before `start` (-1: none)."""
        index = start
        while index >= 0 and self._is_held_by_tree_only(node.block_ids[index]):
            index -= 1
        return index

    def _recount(self, node: RadixNode) -> None:
        """After node's block list changed: find its last pinned block again, then refresh."""
        node.last_pinned_index = self._last_pinned_index(node, len(node.block_ids) - 1)
        self._refresh(node)

    def _refresh(self, node: RadixNode | None) -> None:
        """Update node's evictable blocks and blocked state; go up while the state flips."""
        while node is not None and not node.is_root:
            is_covered = node.num_own_locks > 0 or node.num_blocked_children > 0
            num_unpinned = len(node.block_ids) - 1 - node.last_pinned_index
            num_evictable = 0 if is_covered else num_unpinned
            self._num_evictable += num_evictable - node.num_evictable_blocks
            node.num_evictable_blocks = num_evictable
            is_blocked = is_covered or node.last_pinned_index >= 0
            if is_blocked == node.is_blocked:
                return
            node.is_blocked = is_blocked
            if node.parent is not None:
                node.parent.num_blocked_children += 1 if is_blocked else -1
            node = node.parent

    def _offer(self, node: RadixNode | None) -> None:
        """Queue node for evict() if it is an eviction candidate now (duplicates are fine)."""
        if node is None or not self._is_candidate(node):
            return
        self._heap.push(node, len(self._node_of_block), self._is_current)
        self._quota.offer(node.namespace, node, self._is_current)

    def _is_current(self, last_access: int, node: RadixNode) -> bool:
        return last_access == node.last_access and self._is_candidate(node)

    # -- eviction and removal -----------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks blocks, least recently used leaves first, tail blocks first.

        Only unlocked leaves whose tail block has refcount 1 (held by the tree alone) are
        trimmed, so a block a sequence still holds is never taken from the tree. Returns
        the freed block ids, which are back on the pool's free list.
        """
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = self._next_victim()
            if node is None:
                break
            block_id = node.block_ids[-1]
            next_candidate = self._detach(node) if len(node.block_ids) == 1 else node
            self._release_block(block_id)
            node.block_ids.pop()
            node.token_ids = node.token_ids[: len(node.block_ids) * self.block_size]
            self._refresh(node)  # an unpinned tail block left: one evictable block fewer
            freed.append(block_id)
            self._offer(next_candidate)  # the same leaf, or a parent now a leaf
        self.num_evictions += len(freed)
        self._flush_removed()
        return freed

    def _next_victim(self) -> RadixNode | None:
        """The leaf to trim next: the LRU one of the namespaces over their cap, if any of
        them has one, else the LRU one of all (stale heap entries are skipped)."""
        node = self._quota.pop_over_cap(self._is_current) if self._quota.has_cap else None
        return node if node is not None else self._heap.pop(self._is_current)

    def _is_candidate(self, node: RadixNode) -> bool:
        """An attached, unlocked leaf whose tail block only the tree holds (a sequence that
        still holds it would lose nothing: evicting it frees no memory)."""
        return (
            not node.is_root
            and node.parent is not None
            and not node.children
            and node.lock_count == 0
            and bool(node.block_ids)
            and self._is_held_by_tree_only(node.block_ids[-1])
        )

    def _is_held_by_tree_only(self, block_id: int) -> bool:
        return self.pool.refcount(block_id) == 1

    def num_evictable_blocks(self) -> int:
        """How many blocks evict() would free if asked for all of them right now (kept up
        to date: no walk)."""
        return self._num_evictable

    def _count_evictable_by_walk(self) -> int:
        """num_evictable_blocks recounted from the tree (what evict(all) would free), for
        check_integrity()."""
        num_below: dict[int, int] = {}
        is_all_evictable: dict[int, bool] = {}
        total = 0
        for root in self._roots.values():
            for node in reversed(list(self._preorder(root))):
                children = node.children.values()
                num = sum(num_below[c.node_id] for c in children)
                whole = all(is_all_evictable[c.node_id] for c in children)
                if whole and node.lock_count == 0:
                    tail = self._num_evictable_tail_blocks(node)
                    num, whole = num + tail, tail == len(node.block_ids)
                num_below[node.node_id], is_all_evictable[node.node_id] = num, whole
            total += num_below[root.node_id]
        return total

    def _num_evictable_tail_blocks(self, node: RadixNode) -> int:
        num = 0
        for block_id in reversed(node.block_ids):
            if not self._is_held_by_tree_only(block_id):
                break
            num += 1
        return num

    def invalidate(self, block_id: int) -> list[int]:
        """Drop block_id, the blocks after it on its edge and the whole subtree below.

        Their KV was computed from block_id's, so none of it can be trusted (the auditor's
        quarantine). Blocks before it on the edge stay cached. The tree's references go;
        sequences holding these blocks keep theirs (and must not insert them again).
        Locks held on removed nodes stay valid to unlock. Returns the dropped block ids;
        [] for a block the tree does not hold (never cached, or already evicted).
        """
        node = self._node_of_block.get(block_id)
        if node is None:
            return []
        index = self._index_of_block[block_id]
        if index > 0:
            self._split(node, index)
        self._detach(node)
        dropped = self._release_subtree(node)
        self.num_invalidated_blocks += len(dropped)
        self._flush_removed()
        return dropped

    def drop_namespace(self, namespace: Namespace) -> list[int]:
        """Forget a namespace's tree (e.g. its weights were unloaded); returns its blocks.

        A later insert() into the same namespace starts a new tree, so the caller stops
        inserting for sequences of the dropped namespace.
        """
        dropped = self._drop_tree(namespace)
        self._flush_removed()
        return dropped

    def _drop_tree(self, namespace: Namespace) -> list[int]:
        root = self._roots.pop(namespace, None)
        if root is None:
            return []
        dropped: list[int] = []
        for child in list(root.children.values()):
            self._detach(child)
            dropped += self._release_subtree(child)
        return dropped

    def reset(self) -> list[int]:
        """Drop every namespace; returns all block ids the tree released."""
        released = [b for namespace in list(self._roots) for b in self._drop_tree(namespace)]
        self._heap.clear()  # every entry is stale now; keeps no detached node alive
        self._quota.clear_heaps()
        if self._events is not None:
            self._events.cleared()
        return released

    def _release_subtree(self, top: RadixNode) -> list[int]:
        released: list[int] = []
        for node in self._preorder(top):
            for block_id in node.block_ids:
                self._release_block(block_id)
                released.append(block_id)
            node.block_ids, node.token_ids = [], ()
            self._recount(node)
        return released

    def _release_block(self, block_id: int) -> None:
        """Drop the tree's reference; the caller takes the block off its edge and recounts."""
        self._quota.remove_block(self._node_of_block[block_id].namespace)
        del self._node_of_block[block_id]
        del self._index_of_block[block_id]
        if self._events is not None:
            self._events.released(block_id)
        self.pool.set_tree_owned(block_id, False)
        self.pool.decref(block_id)

    def _flush_removed(self) -> None:
        if self._events is not None:
            self._events.flush_removed()

    def _detach(self, node: RadixNode) -> RadixNode:
        """Unhook node from its parent, moving its locks off the ancestors; returns parent."""
        parent = node.parent
        key = node.token_ids[: self.block_size]
        assert parent is not None and parent.children.get(key) is node
        del parent.children[key]
        if node.lock_count:  # an unlocked node (every evicted one) walks nothing up
            self._add_lock_count(parent, -node.lock_count)
        node.parent = None
        if node.is_blocked:
            parent.num_blocked_children -= 1
            self._refresh(parent)
        self._offer(parent)  # it may be a leaf now
        return parent

    # -- inspection ---------------------------------------------------------------------
    def recent_path_block_ids(self) -> list[int]:
        """Blocks from a root down to the most recently used leaf ([] for an empty tree)."""
        leaves = [
            node
            for root in self._roots.values()
            for node in self._preorder(root)
            if not node.children and not node.is_root
        ]
        if not leaves:
            return []
        node: RadixNode | None = max(leaves, key=lambda n: (n.last_access, n.node_id))
        edges: list[list[int]] = []
        while node is not None and not node.is_root:
            edges.append(node.block_ids)
            node = node.parent
        return [block_id for edge in reversed(edges) for block_id in edge]

    def tree_block_ids(self) -> list[int]:
        """Every block the tree holds a reference to, sorted."""
        return sorted(self._node_of_block)

    @property
    def is_recording_events(self) -> bool:
        return self._events is not None

    def block_hashes(self) -> dict[int, int]:
        """block id -> KV event hash of every tree block, recomputed by walking each tree from
        its namespace seed (independent of what the events recorded). Needs an event sink."""
        assert self._events is not None, "block hashes exist only with KV events on"
        hashes: dict[int, int] = {}
        for namespace, root in self._roots.items():
            seed = namespace_seed(namespace)
            stack = [(child, seed) for child in root.children.values()]
            while stack:
                node, parent_hash = stack.pop()
                chain = chain_block_hashes(parent_hash, node.token_ids, self.block_size)
                hashes.update(zip(node.block_ids, chain, strict=True))
                stack.extend((child, chain[-1]) for child in node.children.values())
        return hashes

    def num_blocks_in_namespace(self, namespace: Namespace) -> int:
        """Tree blocks the namespace holds (kept up to date: no walk)."""
        return self._quota.num_blocks(namespace)

    def namespaces_over_cap(self) -> list[Namespace]:
        """Namespaces holding more tree blocks than max_cached_blocks_per_namespace."""
        return self._quota.namespaces_over_cap()

    @property
    def num_tree_blocks(self) -> int:
        return len(self._node_of_block)

    @property
    def namespaces(self) -> list[Namespace]:
        return list(self._roots)

    @staticmethod
    def _preorder(top: RadixNode) -> Iterator[RadixNode]:
        # Iterative: a long conversation makes a deep path.
        stack = [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree and the pool agree.

        Every tree block is tree-owned with refcount >= 1 and appears once in all trees;
        every tree-owned pool block is in the tree; edges are whole blocks; children are
        keyed by their first block and point back to their parent; lock counts add up; with KV
        events, the hashes recorded for the events equal a recompute from the tree.
        """
        seen: set[int] = set()
        for root in self._roots.values():
            assert root.is_root and root.parent is None and not root.block_ids
            assert root.lock_count == 0 and not root.token_ids
            for node in self._preorder(root):
                self._check_node(node, seen)
        assert seen == set(self._node_of_block) == set(self._index_of_block), (
            "block index out of sync with the tree"
        )
        for block_id in range(self.pool.num_blocks):
            if self.pool.is_tree_owned(block_id):
                assert block_id in seen, f"block {block_id} tree-owned but not in the tree"
        num_walked = self._count_evictable_by_walk()
        assert self._num_evictable == num_walked, (
            f"evictable count {self._num_evictable} != {num_walked} by walking the tree"
        )
        if self._events is not None:
            assert self._events.recorded_hashes() == self.block_hashes(), (
                "KV event hashes out of sync with the tree"
            )
        self._check_queues()

    def _check_queues(self) -> None:
        """Every eviction candidate is queued globally and, with a cap, in its namespace; the
        per-namespace block counts equal a recount."""
        queued = self._heap.queued_node_ids(self._is_current)
        candidates = []
        walked: dict[Namespace, int] = {}
        for namespace, root in self._roots.items():
            assert root.namespace == namespace, f"root of {namespace!r} is {root.namespace!r}"
            for node in self._preorder(root):
                assert node.namespace == namespace, f"node {node.node_id} in a wrong namespace"
                walked[namespace] = walked.get(namespace, 0) + len(node.block_ids)
                if self._is_candidate(node):
                    assert node.node_id in queued, f"eviction candidate {node.node_id} not queued"
                    candidates.append((namespace, node))
        self._quota.check(walked, candidates, self._is_current)

    def _check_figures(self, node: RadixNode) -> None:
        """node's running figures equal a recount (the walk checks the total)."""
        if node.is_root:
            return
        pinned = [i for i, b in enumerate(node.block_ids) if not self._is_held_by_tree_only(b)]
        last_pinned = max(pinned, default=-1)
        num_blocked = sum(child.is_blocked for child in node.children.values())
        is_covered = node.num_own_locks > 0 or num_blocked > 0
        expected = (last_pinned, num_blocked, is_covered or last_pinned >= 0)
        actual = (node.last_pinned_index, node.num_blocked_children, node.is_blocked)
        assert actual == expected, f"node {node.node_id}: figures {actual} != {expected}"
        num_evictable = 0 if is_covered else self._num_evictable_tail_blocks(node)
        assert node.num_evictable_blocks == num_evictable, f"node {node.node_id} evictable"

    def _check_node(self, node: RadixNode, seen: set[int]) -> None:
        bs = self.block_size
        for key, child in node.children.items():
            assert child.parent is node, f"node {child.node_id} has a wrong parent"
            assert key == child.token_ids[:bs], f"node {child.node_id} keyed by {key}"
        child_locks = sum(child.lock_count for child in node.children.values())
        if not node.is_root:
            assert node.block_ids, f"node {node.node_id} has an empty edge"
            assert node.lock_count == node.num_own_locks + child_locks, "lock counts disagree"
        assert len(node.token_ids) == len(node.block_ids) * bs, "edge is not whole blocks"
        assert node.last_access <= self._clock
        for index, block_id in enumerate(node.block_ids):
            assert block_id not in seen, f"block {block_id} appears twice in the tree"
            seen.add(block_id)
            assert self._node_of_block.get(block_id) is node, f"block {block_id} misindexed"
            assert self._index_of_block[block_id] == index, f"block {block_id} index"
            assert self.pool.refcount(block_id) >= 1, f"tree block {block_id} is free"
            assert self.pool.is_tree_owned(block_id), f"tree block {block_id} not tree-owned"
        self._check_figures(node)
