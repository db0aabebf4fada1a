"""Radix tree over token ids -> KV block ids: the prefix cache (torch-free).

Every edge covers whole blocks (len(token_ids) == len(block_ids) * block_size): a node splits
only at a block boundary and every tree block is full. Children are keyed by the tokens of
their edge's first block, so two sequences diverging inside a block are two siblings, each
with its own cached block.

References: the tree holds exactly one pool reference to each block it owns and marks it
tree-owned while it does; sequences' references are theirs, never touched here. One
RadixCache per BlockPool; not thread-safe (the engine thread is the only caller).

Namespaces: one root per namespace key (engine.core.sequence.make_namespace); nothing is
shared across roots. With max_cached_blocks_per_namespace, evict() takes an over-cap
namespace's least recently used blocks first (engine/kv/namespace_quota.py).

Running figures (engine/kv/eviction_queue.py): the evictable count and the LRU heap are kept
up to date as blocks change state, so neither allocation nor a stats read walks the tree;
check_integrity() (engine/kv/radix_integrity.py) recounts everything from scratch. The
read-only tree walks (match, inspection) are in engine/kv/radix_walks.py.

KV events (engine/kv/kv_events.py), only with an event_sink: BlockStored on insert,
BlockRemoved on evict / invalidate / drop_namespace (one event per call), AllBlocksCleared on
reset. Without a sink nothing is hashed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.kv import radix_integrity, radix_walks
from engine.kv.block_pool import BlockPool
from engine.kv.cache_diagnosis import MissReason, PrefixTombstones
from engine.kv.eviction_queue import EvictionQueue
from engine.kv.kv_events import KVEventRecorder, KVEventSink
from engine.kv.namespace_quota import NamespaceQuota
from engine.kv.radix_node import MatchResult, Namespace, RadixNode, path_token_ids, preorder
from engine.kv.radix_walks import common_prefix_len


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
        tombstones: PrefixTombstones | None = None,
    ) -> None:
        self.pool = pool
        self.tombstones = tombstones  # evicted prefixes, for miss diagnosis (None: none kept)
        self.block_size = pool.block_size
        self._events = None if event_sink is None else KVEventRecorder(event_sink, self.block_size)
        self._roots: dict[Namespace, RadixNode] = {}
        self._node_of_block: dict[int, RadixNode] = {}
        self._index_of_block: dict[int, int] = {}  # block -> its index in its node's edge
        self._clock = 0  # monotonic access counter: LRU order is deterministic
        self.num_evictions = 0  # blocks freed by evict()
        self.num_invalidated_blocks = 0  # blocks dropped by invalidate()
        # evict_listener(namespace, token path to the block's end, block_id): each block evict()
        # frees, before it is freed (the second tier spills it: engine/kv/tier_link.py).
        self.evict_listener: Callable[[Namespace, list[int], int], None] | None = None
        self._quota = NamespaceQuota(max_cached_blocks_per_namespace)
        self._eviction = EvictionQueue(pool, self._quota)
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
        return self._result(*radix_walks.longest_prefix(root, token_ids, limit, self.block_size))

    def _result(
        self, full: list[int], partial: int | None, num_partial: int, last: RadixNode | None
    ) -> MatchResult:
        self._touch_path(last)
        num_matched_tokens = len(full) * self.block_size + num_partial
        return MatchResult(tuple(full), partial, num_partial, num_matched_tokens, last)

    def _touch_path(self, node: RadixNode | None) -> None:
        deepest = node  # only it can be a leaf: offered again under its new LRU time
        while node is not None and not node.is_root:
            node.last_access = self._clock
            node = node.parent
        self._eviction.offer(deepest)

    # -- insertion ----------------------------------------------------------------------
    def insert(
        self, namespace: Namespace, token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> int:
        """Cache a sequence's full blocks; returns how many blocks the tree took over.

        token_ids: the sequence's tokens from position 0 (len(block_ids) * block_size). Where
        the tree holds the same tokens it keeps its own block; a new block is increfed and
        becomes tree-owned (read-only). The caller keeps its references either way. Never
        pass blocks invalidate() returned: they would be cached again.
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
            num_blocks = common_prefix_len(child.token_ids, token_ids[index * bs :]) // bs
            index += num_blocks
            if num_blocks < len(child.block_ids) and index < len(block_ids):
                child = self._split(child, num_blocks)
            child.last_access = self._clock
            self._eviction.offer(child)
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
        self._eviction.recount(leaf)

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
        self._eviction.on_split(upper, node)
        return upper

    # -- locking ------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Protect node and all its ancestors from evict(); one unlock(node) undoes it."""
        node.num_own_locks += 1
        self._add_lock_count(node, 1)
        self._eviction.refresh(node)

    def unlock(self, node: RadixNode) -> None:
        assert node.num_own_locks > 0, "unlock without a matching lock"
        node.num_own_locks -= 1
        self._add_lock_count(node, -1)
        self._eviction.refresh(node)

    def _add_lock_count(self, node: RadixNode | None, delta: int) -> None:
        # Stops at a root, or at the top of a detached subtree (parent None).
        while node is not None and not node.is_root:
            node.lock_count += delta
            assert node.lock_count >= 0
            if node.lock_count == 0:
                self._eviction.offer(node)  # unlocked: it may be an eviction candidate again
            node = node.parent

    # -- running figures ----------------------------------------------------------------
    def _on_cached_change(self, block_id: int, is_cached: bool) -> None:
        """The pool's report: a tree block became (or stopped being) held by the tree alone.
        Blocks entering or leaving the tree are not indexed then: their node recounts."""
        node = self._node_of_block.get(block_id)
        if node is not None:
            self._eviction.on_cached_change(node, self._index_of_block[block_id], is_cached)

    # -- eviction and removal -----------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks blocks, least recently used leaves first, tail blocks first;
        returns them (back on the pool's free list). Only unlocked leaves whose tail block the
        tree alone holds are trimmed: a block a sequence holds is never taken."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = self._eviction.pop_victim()
            if node is None:
                break
            block_id = node.block_ids[-1]
            self._record_tombstone(block_id, MissReason.EVICTED)
            if self.evict_listener is not None:
                prefix = self.block_prefix_token_ids(block_id)
                self.evict_listener(node.namespace, prefix, block_id)
            next_candidate = self._detach(node) if len(node.block_ids) == 1 else node
            self._release_block(block_id)
            node.block_ids.pop()
            node.token_ids = node.token_ids[: len(node.block_ids) * self.block_size]
            self._eviction.refresh(node)  # an unpinned tail block left: one evictable block fewer
            freed.append(block_id)
            self._eviction.offer(next_candidate)  # the same leaf, or a parent now a leaf
        self.num_evictions += len(freed)
        self._flush_removed()
        return freed

    def _record_tombstone(self, block_id: int, reason: MissReason) -> None:
        if self.tombstones is not None:
            prefix = self.block_prefix_token_ids(block_id)
            self.tombstones.record(self.namespace_of_block(block_id), prefix, reason)

    def namespace_of_block(self, block_id: int) -> Namespace:
        return self._node_of_block[block_id].namespace

    def block_prefix_token_ids(self, block_id: int) -> list[int]:
        """The token ids from position 0 to the end of a block the tree holds."""
        node = self._node_of_block[block_id]
        return path_token_ids(node, (self._index_of_block[block_id] + 1) * self.block_size)

    def holds_first_block_elsewhere(self, namespace: Namespace, token_ids: Sequence[int]) -> bool:
        """Whether a namespace other than `namespace` caches token_ids' first full block."""
        first = tuple(token_ids[: self.block_size])
        if len(first) < self.block_size:
            return False
        return any(ns != namespace and first in root.children for ns, root in self._roots.items())

    def num_evictable_blocks(self) -> int:
        """How many blocks evict() would free if asked for all of them right now (kept up
        to date: no walk)."""
        return self._eviction.num_evictable_blocks

    def invalidate(self, block_id: int) -> list[int]:
        """Drop block_id, the blocks after it on its edge and the subtree below (their KV was
        computed from it: the auditor's quarantine); returns them ([] if the tree does not
        hold block_id). Sequences holding them keep their references and must not insert
        them again; locks on removed nodes stay valid to unlock."""
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
        """Forget a namespace's tree (e.g. its weights were unloaded); returns its blocks. A
        later insert() there starts a new tree: the caller stops inserting for that namespace."""
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
        self._eviction.clear()
        if self._events is not None:
            self._events.cleared()
        return released

    def _release_subtree(self, top: RadixNode) -> list[int]:
        released: list[int] = []
        for node in preorder(top):
            for block_id in node.block_ids:
                self._release_block(block_id)
                released.append(block_id)
            node.block_ids, node.token_ids = [], ()
            self._eviction.recount(node)
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
        self._eviction.on_detach(node, parent)
        return parent

    # -- inspection ---------------------------------------------------------------------
    def recent_path_block_ids(self) -> list[int]:
        """Blocks from a root down to the most recently used leaf ([] for an empty tree)."""
        return radix_walks.recent_path_block_ids(self._roots.values())

    def cached_paths(self) -> list[tuple[Namespace, list[int], int]]:
        """(namespace, token path to the block's end, block id) of every tree block, least
        recently used first (a walk: for a graceful stop, not per step)."""
        return radix_walks.cached_paths(self._roots.values(), self.block_size)

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
        return radix_walks.block_hashes(self._roots, self.block_size)

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

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree and the pool agree: the tree's blocks are
        exactly the tree-owned ones, each held and listed once; edges are whole blocks; lock
        counts and running figures add up; with KV events, the recorded hashes equal a recompute."""
        radix_integrity.check_integrity(self)
