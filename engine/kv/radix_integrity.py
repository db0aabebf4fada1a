"""RadixCache.check_integrity(): the tree, the pool and the running figures recounted (torch-free).

A part of engine/kv/radix_cache.py kept in its own file: it reads the cache's private state,
walks every tree and the whole pool from scratch, and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.radix_node import Namespace, RadixNode, preorder

if TYPE_CHECKING:
    from engine.kv.radix_cache import RadixCache


def check_integrity(cache: RadixCache) -> None:
    """Raise AssertionError unless the tree and the pool agree (see RadixCache)."""
    seen: set[int] = set()
    for root in cache._roots.values():
        assert root.is_root and root.parent is None and not root.block_ids
        assert root.lock_count == 0 and not root.token_ids
        for node in preorder(root):
            _check_node(cache, node, seen)
    assert seen == set(cache._node_of_block) == set(cache._index_of_block), (
        "block index out of sync with the tree"
    )
    for block_id in range(cache.pool.num_blocks):
        if cache.pool.is_tree_owned(block_id):
            assert block_id in seen, f"block {block_id} tree-owned but not in the tree"
    num_evictable, num_walked = cache.num_evictable_blocks(), _count_evictable_by_walk(cache)
    assert num_evictable == num_walked, (
        f"evictable count {num_evictable} != {num_walked} by walking the tree"
    )
    if cache._events is not None:
        assert cache._events.recorded_hashes() == cache.block_hashes(), (
            "KV event hashes out of sync with the tree"
        )
    _check_queues(cache)


def _check_node(cache: RadixCache, node: RadixNode, seen: set[int]) -> None:
    bs = cache.block_size
    for key, child in node.children.items():
        assert child.parent is node, f"node {child.node_id} has a wrong parent"
        assert key == child.token_ids[:bs], f"node {child.node_id} keyed by {key}"
    child_locks = sum(child.lock_count for child in node.children.values())
    if not node.is_root:
        assert node.block_ids, f"node {node.node_id} has an empty edge"
        assert node.lock_count == node.num_own_locks + child_locks, "lock counts disagree"
    assert len(node.token_ids) == len(node.block_ids) * bs, "edge is not whole blocks"
    assert node.last_access <= cache._clock
    for index, block_id in enumerate(node.block_ids):
        assert block_id not in seen, f"block {block_id} appears twice in the tree"
        seen.add(block_id)
        assert cache._node_of_block.get(block_id) is node, f"block {block_id} misindexed"
        assert cache._index_of_block[block_id] == index, f"block {block_id} index"
        assert cache.pool.refcount(block_id) >= 1, f"tree block {block_id} is free"
        assert cache.pool.is_tree_owned(block_id), f"tree block {block_id} not tree-owned"
    _check_figures(cache, node)


def _check_figures(cache: RadixCache, node: RadixNode) -> None:
    """node's running figures equal a recount (the walk checks the total)."""
    if node.is_root:
        return
    is_held_by_tree_only = cache._eviction.is_held_by_tree_only
    pinned = [i for i, b in enumerate(node.block_ids) if not is_held_by_tree_only(b)]
    last_pinned = max(pinned, default=-1)
    num_blocked = sum(child.is_blocked for child in node.children.values())
    is_covered = node.num_own_locks > 0 or num_blocked > 0
    expected = (last_pinned, num_blocked, is_covered or last_pinned >= 0)
    actual = (node.last_pinned_index, node.num_blocked_children, node.is_blocked)
    assert actual == expected, f"node {node.node_id}: figures {actual} != {expected}"
    num_evictable = 0 if is_covered else _num_evictable_tail_blocks(cache, node)
    assert node.num_evictable_blocks == num_evictable, f"node {node.node_id} evictable"


def _count_evictable_by_walk(cache: RadixCache) -> int:
    """num_evictable_blocks recounted from the tree (what evict(all) would free)."""
    num_below: dict[int, int] = {}
    is_all_evictable: dict[int, bool] = {}
    total = 0
    for root in cache._roots.values():
        for node in reversed(list(preorder(root))):
            children = node.children.values()
            num = sum(num_below[c.node_id] for c in children)
            whole = all(is_all_evictable[c.node_id] for c in children)
            if whole and node.lock_count == 0:
                tail = _num_evictable_tail_blocks(cache, node)
                num, whole = num + tail, tail == len(node.block_ids)
            num_below[node.node_id], is_all_evictable[node.node_id] = num, whole
        total += num_below[root.node_id]
    return total


def _num_evictable_tail_blocks(cache: RadixCache, node: RadixNode) -> int:
    num = 0
    for block_id in reversed(node.block_ids):
        if not cache._eviction.is_held_by_tree_only(block_id):
            break
        num += 1
    return num


def _check_queues(cache: RadixCache) -> None:
    """Every eviction candidate is queued globally and, with a cap, in its namespace; the
    per-namespace block counts equal a recount."""
    queued = cache._eviction.queued_node_ids()
    candidates = []
    walked: dict[Namespace, int] = {}
    for namespace, root in cache._roots.items():
        assert root.namespace == namespace, f"root of {namespace!r} is {root.namespace!r}"
        for node in preorder(root):
            assert node.namespace == namespace, f"node {node.node_id} in a wrong namespace"
            walked[namespace] = walked.get(namespace, 0) + len(node.block_ids)
            if cache._eviction.is_candidate(node):
                assert node.node_id in queued, f"eviction candidate {node.node_id} not queued"
                candidates.append((namespace, node))
    cache._quota.check(walked, candidates, cache._eviction.is_current)
