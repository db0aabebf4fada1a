"""The prefix tree's plain data: its nodes and the result of a match (torch-free).

engine/kv/radix_cache.py builds them and changes the tree's shape; engine/kv/eviction_queue.py
keeps their eviction figures up to date. Callers hold them as opaque handles
(MatchResult.last_node for lock() / unlock()) and read a MatchResult's fields.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from itertools import count

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
    # Running figures (engine/kv/eviction_queue.py keeps them): the index of this edge's last
    # pinned block (-1: none), children that are blocked, whether this node is blocked, and
    # how many of its blocks evict() can free (those after the last pinned one).
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


def preorder(top: RadixNode) -> Iterator[RadixNode]:
    """top and every node below it, parents before children."""
    # Iterative: a long conversation makes a deep path.
    stack = [top]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def path_token_ids(node: RadixNode, num_edge_tokens: int) -> list[int]:
    """The token ids from the root down to node, ending after num_edge_tokens of its edge."""
    parts = [node.token_ids[:num_edge_tokens]]
    above = node.parent
    while above is not None and not above.is_root:
        parts.append(above.token_ids)
        above = above.parent
    return [token for part in reversed(parts) for token in part]
