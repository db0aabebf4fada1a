"""The second KV tier (torch-free): blocks the pool evicts from the prefix tree, kept by their
exact token path, loaded back instead of recomputed, each load verified (DESIGN invariant 8).

Index. A trie per namespace, one level per block, children keyed by the block's token ids, so
a lookup compares every token from position 0 (invariant 3) exactly as the radix tree does;
a node has an entry when the tier holds that block's KV. Nodes without an entry stand for
blocks that are still in the pool (a tier match continues the pool's match).

Bounds. max_bytes over all entries, least recently used dropped first; with a per-namespace
cap (max_cached_blocks_per_namespace), a namespace's tier entries and its pool blocks together
stay within it: its own oldest entries go first (a tenant's tier usage counts against its cache
cap).

Verification on every load (load()): the entry's checksum, the fingerprint it was written under
(weights, tokenizer, block size, KV dtype and layout, compute mode, format version), and its
namespace and token path against the ones looked up. An entry that fails any of them is dropped
and counted, and the load stops there: the caller computes the rest. Entries restored at start
(restore()) are indexed from their heads only and verified the same way when first loaded.

Engine thread only, except what the store does on its own thread (engine/kv/tier_store.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from engine.kv.tier_format import EntryHead, encode_entry, entry_key, namespace_key
from engine.kv.tier_reads import Fetch, Fetched, Located, fetch
from engine.kv.tier_store import TierStore

logger = logging.getLogger(__name__)

_MAX_RECENT = 10_000


@dataclass
class TierCounters:
    """Running figures of the tier (read by the engine's stats snapshot)."""

    num_stored: int = 0  # entries written (evicted blocks, and the pool at a graceful stop)
    num_loaded_blocks: int = 0  # blocks loaded back into the pool, verified
    num_loaded_tokens: int = 0
    num_checksum_failures: int = 0  # bytes that are not what was written (flips, truncation)
    num_refused: int = 0  # a valid entry of another fingerprint, namespace or token path
    num_missing: int = 0  # indexed but gone from the store
    num_dropped: int = 0  # dropped for room (bytes cap, namespace cap)
    num_invalidated: int = 0  # dropped with a quarantined block
    num_restored_at_start: int = 0
    num_ignored_at_start: int = 0  # another fingerprint, unreadable, or misnamed
    recent_load_seconds: list[float] = field(default_factory=list)  # drained by the stats

    def drain_load_seconds(self) -> list[float]:
        drained, self.recent_load_seconds = self.recent_load_seconds, []
        return drained


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    block_tokens: tuple[int, ...]
    namespace: tuple[str, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    entry: _Entry | None = None


@dataclass(eq=False)
class _Entry:
    key: str
    node: _Node
    num_bytes: int


class KVTier:
    """Index, bounds and verification of the tier's entries over a TierStore."""

    def __init__(
        self,
        store: TierStore,
        fingerprint: str,
        block_size: int,
        max_bytes: int,
        max_blocks_per_namespace: int | None = None,
        read_ahead: bool = False,
    ) -> None:
        self.store = store
        # Read a waiting sequence's entries on a reader thread (engine/kv/tier_reads.py);
        # False: on the engine thread, within its admission.
        self.read_ahead = read_ahead
        self.kind = store.kind
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.max_blocks_per_namespace = max_blocks_per_namespace
        self._num_blocks_in_pool: Callable[[Hashable], int] = lambda _namespace: 0
        self._roots: dict[tuple[str, ...], _Node] = {}
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._lru_by_namespace: dict[tuple[str, ...], OrderedDict[str, _Entry]] = {}
        self.num_bytes = 0
        self.counters = TierCounters()
        self.is_closed = False

    def set_pool_counter(self, num_blocks_in_pool: Callable[[Hashable], int]) -> None:
        """num_blocks_in_pool(namespace): its prefix-tree blocks (for the namespace cap)."""
        self._num_blocks_in_pool = num_blocks_in_pool

    # -- figures ----------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def num_entries_in(self, namespace: Hashable) -> int:
        return len(self._lru_by_namespace.get(namespace_key(namespace), ()))

    def most_recent_key(self) -> str | None:
        """The key of the most recently used entry (fault drills)."""
        return next(reversed(self._lru), None)

    def contains(self, namespace: Hashable, token_ids: Sequence[int], touch: bool = False) -> bool:
        """Whether the tier holds the block ending token_ids (a whole-block token path); with
        `touch`, a held entry becomes the most recently used."""
        node = self._find(namespace_key(namespace), token_ids, create=False)
        if node is None or node.entry is None:
            return False
        if touch:
            self._touch(node.entry)
        return True

    # -- lookup and load --------------------------------------------------------------------
    def match(
        self, namespace: Hashable, token_ids: Sequence[int], first_block: int, max_blocks: int
    ) -> int:
        """How many consecutive blocks from block index first_block on the tier holds for
        token_ids (at most max_blocks); the blocks before first_block are the caller's."""
        node = self._roots.get(namespace_key(namespace))
        bs = self.block_size
        num_found = 0
        index = 0
        while node is not None and num_found < max_blocks:
            block = tuple(token_ids[index * bs : (index + 1) * bs])
            if len(block) < bs:
                break
            node = node.children.get(block)
            if node is None:
                break
            if index >= first_block:
                if node.entry is None:
                    break
                num_found += 1
            index += 1
        return num_found

    def locate(
        self, namespace: Hashable, token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> tuple[Located, ...]:
        """The indexed entries of blocks first_block .. first_block + num_blocks - 1 of
        token_ids, up to the first the tier does not hold."""
        ns = namespace_key(namespace)
        bs = self.block_size
        located: list[Located] = []
        for index in range(first_block, first_block + num_blocks):
            path = tuple(token_ids[: (index + 1) * bs])
            node = self._find(ns, path, create=False)
            if node is None or node.entry is None:
                break
            located.append(Located(node.entry.key, path))
        return tuple(located)

    def load(
        self, namespace: Hashable, token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> list[bytes]:
        """The KV payloads of blocks first_block .. first_block + num_blocks - 1 of token_ids,
        read here and each verified; stops at the first entry that fails (dropped, counted)."""
        located = self.locate(namespace, token_ids, first_block, num_blocks)
        return self.accept(namespace, fetch(self.store, located))

    def accept(self, namespace: Hashable, read: Fetch) -> list[bytes]:
        """The payloads of a fetch() (here or on a reader thread) that pass verification, in
        order: each entry must still be indexed under its key and hold this fingerprint, this
        namespace and its token path. Stops at the first that fails (dropped and counted)."""
        ns = namespace_key(namespace)
        payloads: list[bytes] = []
        for located, fetched in zip(read.located, read.results, strict=False):
            node = self._find(ns, located.path, create=False)
            entry = node.entry if node is not None else None
            if entry is None or entry.key != located.key:
                break  # dropped meanwhile
            payload = self._verified(entry, ns, located.path, fetched)
            if payload is None:
                break
            self._touch(entry)
            payloads.append(payload)
        if payloads:
            self.counters.num_loaded_blocks += len(payloads)
            self.counters.num_loaded_tokens += len(payloads) * self.block_size
            self._record_seconds(read.seconds)
        return payloads

    def _verified(
        self, entry: _Entry, namespace: tuple[str, ...], path: tuple[int, ...], fetched: Fetched
    ) -> bytes | None:
        if fetched.entry is None and fetched.error == "missing":
            self.counters.num_missing += 1
            self._drop(entry)
            return None
        if fetched.entry is None:
            self.counters.num_checksum_failures += 1
            logger.warning(
                "KV tier: entry %s failed verification (%s); dropped", entry.key, fetched.error
            )
            self._drop(entry)
            return None
        head, payload = fetched.entry
        if (
            head.fingerprint != self.fingerprint
            or head.namespace != namespace
            or head.token_ids != path
        ):
            self.counters.num_refused += 1
            logger.warning(
                "KV tier: entry %s holds another fingerprint, namespace or token path; dropped",
                entry.key,
            )
            self._drop(entry)
            return None
        return payload

    def _record_seconds(self, seconds: float) -> None:
        if len(self.counters.recent_load_seconds) < _MAX_RECENT:
            self.counters.recent_load_seconds.append(seconds)

    # -- storing ----------------------------------------------------------------------------
    def add(self, namespace: Hashable, token_ids: Sequence[int], payload: bytes) -> bool:
        """Keep a block's KV under its token path (whole blocks from position 0); False when
        it is already held or cannot fit the cap."""
        ns = namespace_key(namespace)
        path = tuple(token_ids)
        assert path and len(path) % self.block_size == 0, "a tier entry is a whole-block path"
        node = self._find(ns, path, create=True)
        if node.entry is not None:
            self._touch(node.entry)
            return False
        data = encode_entry(EntryHead(self.fingerprint, ns, path, len(payload)), payload)
        if len(data) > self.max_bytes:
            self._prune(node)
            return False
        key = entry_key(ns, path)
        if not self.store.put(key, data):  # the store is behind (counted there)
            self._prune(node)
            return False
        self._index(node, key, len(data))
        self.counters.num_stored += 1
        self._enforce_caps(ns)
        return True

    def _index(self, node: _Node, key: str, num_bytes: int) -> None:
        entry = _Entry(key, node, num_bytes)
        node.entry = entry
        self._lru[key] = entry
        self._lru_by_namespace.setdefault(node.namespace, OrderedDict())[key] = entry
        self.num_bytes += num_bytes

    def _enforce_caps(self, namespace: tuple[str, ...]) -> None:
        cap = self.max_blocks_per_namespace
        if cap is not None:
            own = self._lru_by_namespace.get(namespace)
            while own and len(own) + self._num_blocks_in_pool(namespace) > cap:
                self._drop(next(iter(own.values())))
                self.counters.num_dropped += 1
        while self.num_bytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru.values())))
            self.counters.num_dropped += 1

    # -- removal ----------------------------------------------------------------------------
    def invalidate(self, namespace: Hashable, token_ids: Sequence[int]) -> int:
        """Drop the entry of the block ending token_ids and every entry after it (their KV was
        computed from it): a quarantined block never comes back from the tier. Returns how many
        were dropped."""
        node = self._find(namespace_key(namespace), token_ids, create=False)
        if node is None:
            return 0
        below = [node]
        entries = []
        while below:
            current = below.pop()
            below.extend(current.children.values())
            if current.entry is not None:
                entries.append(current.entry)
        for entry in entries:
            self._drop(entry)
        self.counters.num_invalidated += len(entries)
        return len(entries)

    def _drop(self, entry: _Entry) -> None:
        self.store.delete(entry.key)
        del self._lru[entry.key]
        own = self._lru_by_namespace[entry.node.namespace]
        del own[entry.key]
        if not own:
            del self._lru_by_namespace[entry.node.namespace]
        self.num_bytes -= entry.num_bytes
        entry.node.entry = None
        self._prune(entry.node)

    def _prune(self, node: _Node) -> None:
        """Remove node and the ancestors left with neither an entry nor children."""
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.block_tokens]
            node = node.parent
        if node.parent is None and not node.children:
            self._roots.pop(node.namespace, None)

    # -- restart ----------------------------------------------------------------------------
    def restore(self) -> int:
        """Index the entries a previous process left in a persistent store (from their heads;
        each is verified when first loaded). Entries of another fingerprint, unreadable ones
        and misnamed ones are deleted and counted. Returns the number indexed."""
        num_foreign = num_unreadable = 0
        for stored in self.store.scan():
            head = stored.head
            if head is None or not self._is_well_formed(head, stored.key):
                num_unreadable += 1
                self.store.delete(stored.key)
            elif head.fingerprint != self.fingerprint:
                num_foreign += 1
                self.store.delete(stored.key)
            else:
                node = self._find(head.namespace, head.token_ids, create=True)
                if node.entry is not None:
                    continue
                self._index(node, stored.key, stored.num_bytes)
                self.counters.num_restored_at_start += 1
        for namespace in list(self._lru_by_namespace):
            self._enforce_caps(namespace)
        self.counters.num_ignored_at_start = num_foreign + num_unreadable
        if num_foreign:
            logger.warning(
                "KV tier: ignored and removed %d entries written under another fingerprint "
                "(other weights, tokenizer, block size, KV dtype, compute mode or format "
                "version)",
                num_foreign,
            )
        if num_unreadable:
            logger.warning("KV tier: removed %d unreadable or misnamed entries", num_unreadable)
        logger.info(
            "KV tier (%s): %d entries restored (%.1f MiB)",
            self.kind,
            self.num_entries,
            self.num_bytes / (1 << 20),
        )
        return self.num_entries

    def clear_store(self) -> None:
        """Delete everything a previous process left in the store (a start without warm
        restart: its entries would only take room)."""
        for stored in self.store.scan():
            self.store.delete(stored.key)

    def _is_well_formed(self, head: EntryHead, key: str) -> bool:
        num_tokens = len(head.token_ids)
        return (
            num_tokens > 0
            and num_tokens % self.block_size == 0
            and key == entry_key(head.namespace, head.token_ids)
        )

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()
        self.is_closed = True

    # -- helpers ----------------------------------------------------------------------------
    def _touch(self, entry: _Entry) -> None:
        self._lru.move_to_end(entry.key)
        self._lru_by_namespace[entry.node.namespace].move_to_end(entry.key)

    def _find(self, namespace: tuple[str, ...], token_ids: Sequence[int], create: bool):
        """The node of the block ending token_ids (whole blocks), created with its ancestors
        when `create`; None when absent."""
        bs = self.block_size
        node = self._roots.get(namespace)
        if node is None:
            if not create:
                return None
            node = self._roots[namespace] = _Node(None, (), namespace)
        for index in range(len(token_ids) // bs):
            block = tuple(token_ids[index * bs : (index + 1) * bs])
            child = node.children.get(block)
            if child is None:
                if not create:
                    return None
                child = node.children[block] = _Node(node, block, namespace)
            node = child
        return node
