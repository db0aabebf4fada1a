"""KV cache events: what the prefix cache stores and removes, as plain records (torch-free).

Routers (NVIDIA Dynamo, llm-d precise prefix scoring) track what each replica has cached
from these events. The records mirror vLLM's KV events (vllm/distributed/kv_events.py); the
ZMQ publisher that encodes and sends them lives outside this package
(engine/kv_event_publisher.py, which documents the wire format).

Block hashes. Every block the tree owns is full, so a block is named by a hash chained over
the full blocks of its path from position 0:

    seed    = H(b"kvshare-namespace", canonical namespace)    (weights version, adapter, salt)
    hash_0  = H(seed, token ids of block 0)
    hash_i  = H(hash_{i-1}, token ids of block i)

H is SHA-256 over a canonical encoding (each 64-bit parent as 8 big-endian bytes, each token id
as 4 big-endian bytes), truncated to its first 8 bytes read as an UNSIGNED big-endian 64-bit
int (0 .. 2**64 - 1; msgpack uint64). The namespace seed is folded into the first hash, so equal
tokens of two tenants (or adapters, or weight versions) never share a hash; the seed itself
names no block (a chain's first BlockStored has parent_block_hash None). A block's hash depends
on every token before it, so it is stable across restarts and replicas of the same weights.

Recording. A RadixCache built with an event sink (any callable taking one event, e.g.
list.append) owns a KVEventRecorder: it hashes each block once, when the tree takes it, keeps
block id -> hash so removals name hashes without recomputing, and calls the sink with
BlockStored / BlockRemoved / AllBlocksCleared. Without a sink the cache hashes nothing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

_NAMESPACE_TAG = b"kvshare-namespace"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the cache took, in path order: block_hashes[0]'s parent is
    parent_block_hash (None: it starts at position 0), each later one's parent is the one before.
    token_ids holds block_size tokens per block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the cache no longer holds (evicted, quarantined, or their namespace dropped)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The cache dropped everything (reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def _encode_namespace(namespace: Hashable) -> bytes:
    """Canonical bytes of a namespace: a tuple's items (or the value itself) as UTF-8 text,
    each length-prefixed, so ("ab", "c") and ("a", "bc") differ."""
    items = namespace if isinstance(namespace, tuple) else (namespace,)
    parts = [str(item).encode("utf-8") for item in items]
    return b"".join(struct.pack(">I", len(part)) + part for part in parts)


def namespace_seed(namespace: Hashable) -> int:
    """The 64-bit value a namespace's chains start from (never a block's hash)."""
    return _digest64(_NAMESPACE_TAG + _encode_namespace(namespace))


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """One block's hash from its parent's (or the namespace seed) and its token ids."""
    return _digest64(struct.pack(f">Q{len(token_ids)}I", parent, *token_ids))


def chain_block_hashes(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of consecutive full blocks after `parent` (a block hash or a seed)."""
    assert len(token_ids) % block_size == 0, "only full blocks are hashed"
    hashes = []
    for start in range(0, len(token_ids), block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class KVEventRecorder:
    """The radix cache's event side: hashes blocks as the tree takes them, remembers them
    until the tree drops them, and hands events to `sink`.

    Called by RadixCache on the engine thread only. Removals are collected per block
    (released()) and sent as one BlockRemoved per cache operation (flush_removed()).
    """

    def __init__(self, sink: KVEventSink, block_size: int) -> None:
        self._sink = sink
        self.block_size = block_size
        self._hash_of_block: dict[int, int] = {}
        self._seeds: dict[Hashable, int] = {}
        self._removed: list[int] = []

    def seed(self, namespace: Hashable) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = namespace_seed(namespace)
        return seed

    def stored(
        self,
        namespace: Hashable,
        parent_block_id: int | None,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
    ) -> None:
        """The tree took block_ids (holding token_ids) after parent_block_id (None: at the
        namespace's root)."""
        parent_hash = None if parent_block_id is None else self._hash_of_block[parent_block_id]
        start = self.seed(namespace) if parent_hash is None else parent_hash
        hashes = chain_block_hashes(start, token_ids, self.block_size)
        self._hash_of_block.update(zip(block_ids, hashes, strict=True))
        self._sink(BlockStored(tuple(hashes), parent_hash, tuple(token_ids), self.block_size))

    def released(self, block_id: int) -> None:
        self._removed.append(self._hash_of_block.pop(block_id))

    def flush_removed(self) -> None:
        """Send the removals collected since the last flush as one BlockRemoved."""
        if self._removed:
            removed, self._removed = self._removed, []
            self._sink(BlockRemoved(tuple(removed)))

    def cleared(self) -> None:
        """The tree dropped every block: one AllBlocksCleared instead of the removals."""
        self._removed = []
        self._hash_of_block.clear()
        self._sink(AllBlocksCleared())

    def hash_of_block(self, block_id: int) -> int:
        return self._hash_of_block[block_id]

    def recorded_hashes(self) -> dict[int, int]:
        """block id -> hash of every block recorded as stored and not yet removed."""
        return dict(self._hash_of_block)
