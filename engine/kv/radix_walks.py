"""Read-only walks over radix trees of RadixNode (torch-free): the longest cached prefix of a
sequence's tokens, the most recently used path, the KV event hash of every block, every block's
token path (a graceful stop's save to the second tier).

Pure functions of the nodes: no access time, lock or reference changes here; RadixCache
(engine/kv/radix_cache.py) calls them and keeps its own state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from engine.kv.kv_events import chain_block_hashes, namespace_seed
from engine.kv.radix_node import Namespace, RadixNode, path_token_ids, preorder

# (full block ids, partial block id, tokens matched in it, deepest node matched)
Prefix = tuple[list[int], int | None, int, RadixNode | None]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    diffs = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(diffs, min(len(a), len(b)))


def longest_prefix(
    root: RadixNode, token_ids: Sequence[int], limit: int, block_size: int
) -> Prefix:
    """The longest prefix of token_ids[:limit] the tree under root holds, compared token by
    token from position 0; a match ending inside a block names that block as the partial one."""
    node, block_index, pos = root, 0, 0
    full_block_ids: list[int] = []
    last_node: RadixNode | None = None
    while pos < limit:
        window = token_ids[pos : min(pos + block_size, limit)]
        if block_index == len(node.block_ids):
            child = best_child(node, window, block_size)
            if child is None:
                break
            node, block_index = child, 0
        start = block_index * block_size
        num_matching = common_prefix_len(node.token_ids[start : start + block_size], window)
        if num_matching == 0:
            break
        last_node = node
        if num_matching < block_size:
            return full_block_ids, node.block_ids[block_index], num_matching, node
        full_block_ids.append(node.block_ids[block_index])
        block_index += 1
        pos += block_size
    return full_block_ids, None, 0, last_node


def best_child(node: RadixNode, window: Sequence[int], block_size: int) -> RadixNode | None:
    """The child sharing the longest prefix with window (>= 1 token), or None."""
    if len(window) == block_size:
        exact = node.children.get(tuple(window))
        if exact is not None:
            return exact
    best, best_len = None, 0
    for child in node.children.values():  # insertion order: ties resolve the same way
        n = common_prefix_len(child.token_ids[:block_size], window)
        if n > best_len:
            best, best_len = child, n
    return best


def recent_path_block_ids(roots: Iterable[RadixNode]) -> list[int]:
    """Blocks from a root down to the most recently used leaf ([] for empty trees)."""
    leaves = [
        node for root in roots for node in preorder(root) if not node.children and not node.is_root
    ]
    if not leaves:
        return []
    node: RadixNode | None = max(leaves, key=lambda n: (n.last_access, n.node_id))
    edges: list[list[int]] = []
    while node is not None and not node.is_root:
        edges.append(node.block_ids)
        node = node.parent
    return [block_id for edge in reversed(edges) for block_id in edge]


def block_hashes(roots: Mapping[Namespace, RadixNode], block_size: int) -> dict[int, int]:
    """block id -> KV event hash of every tree block, chained from each namespace's seed."""
    hashes: dict[int, int] = {}
    for namespace, root in roots.items():
        seed = namespace_seed(namespace)
        stack = [(child, seed) for child in root.children.values()]
        while stack:
            node, parent_hash = stack.pop()
            chain = chain_block_hashes(parent_hash, node.token_ids, block_size)
            hashes.update(zip(node.block_ids, chain, strict=True))
            stack.extend((child, chain[-1]) for child in node.children.values())
    return hashes


def cached_paths(
    roots: Iterable[RadixNode], block_size: int
) -> list[tuple[Namespace, list[int], int]]:
    """(namespace, token path to the block's end, block id) of every block under the roots,
    least recently used first and, among blocks used together, the deepest first: a tail of the
    list holds every block's ancestors (a block's ancestors are used whenever it is)."""
    found = []
    for root in roots:
        for node in preorder(root):
            for index, block_id in enumerate(node.block_ids):
                path = path_token_ids(node, (index + 1) * block_size)
                found.append((node.last_access, -len(path), node.namespace, path, block_id))
    found.sort(key=lambda item: item[:2])
    return [(namespace, path, block_id) for _, _, namespace, path, block_id in found]
