"""The one facade the scheduler uses for KV memory (torch-free).

It hides the block pool and the radix prefix cache: the scheduler admits, grows, forks and
frees sequences, and never touches refcounts, free lists or tree nodes itself. The prefix-cache
half (admit, insert_prefix, diagnose) is its base class, engine/kv/prefix_sharing.py.

References: a live sequence holds one reference on every block of its block table, the
prefix tree one on each block it owns, and other holders (the cache auditor, through
hold_blocks() / allocate_held_blocks() until release_blocks()) one on each block they took;
check_integrity() verifies that the pool's refcounts are exactly those. A sequence admitted
with a cached prefix also holds one lock on the tree node its match ended in, until its first
chunk is computed (its block copy is done by then) or it is freed.

Quarantine: quarantine() drops blocks found wrong from the tree; a sequence still holding one
keeps reading it, but insert_prefix() never offers it, nor any block after it in that table
(computed from it), again. A block leaves the quarantine with its last reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.core.batch import BlockCopy
from engine.core.errors import KVEventsDisabled
from engine.core.intmath import cdiv
from engine.core.sequence import Sequence
from engine.kv import kv_integrity
from engine.kv.block_pool import BlockPool, BlockUsage
from engine.kv.cache_diagnosis import DEFAULT_NUM_TOMBSTONES, MissReason, PrefixTombstones
from engine.kv.kv_events import KVEventSink
from engine.kv.kv_tier import KVTier
from engine.kv.prefix_sharing import PrefixSharing
from engine.kv.radix_cache import RadixCache
from engine.kv.radix_node import Namespace, RadixNode
from engine.kv.tier_link import TierLink


class WriteViolation(RuntimeError):
    """A slot mapping would write into a block another holder can read (invariant 2).

    block_id: the block it would write (None when the position lies past the block table).
    """

    def __init__(self, message: str, block_id: int | None = None) -> None:
        super().__init__(message)
        self.block_id = block_id


class KVCacheManager(PrefixSharing):
    """Block tables of sequences over a shared BlockPool, with copy-on-write.

    Contract: admit() (a waiting sequence) or allocate_slots() (a running one) before
    slot_mapping(); both for the same num_new_tokens, with seq.num_computed_tokens unchanged
    in between. Block copies recorded by admit() / allocate_slots() are drained by
    take_block_copies() and must reach the runner before that step's forward.

    With enable_prefix_cache, a RadixCache over the same pool (`prefix_cache`, else None)
    shares KV within a namespace, and allocation evicts unlocked cached blocks (LRU) before it
    fails. kv_event_sink receives the cache's KV events (engine/kv/kv_events.py);
    max_cached_blocks_per_namespace evicts an over-cap namespace's blocks first
    (engine/kv/namespace_quota.py; None: plain LRU). With a `tier` (and the cache on), evicted
    blocks go to that second tier and admissions load from it (engine/kv/tier_link.py):
    take_block_spills() / take_block_loads() drain the step's transfers like the copies.

    `pool` and `prefix_cache` are exposed for tests and checks; the scheduler, admission and
    the auditor use the methods only. Every figure is O(1) or O(live sequences): only
    check_integrity() walks the pool or the tree.
    """

    def __init__(
        self,
        block_pool: BlockPool,
        enable_prefix_cache: bool = False,
        kv_event_sink: KVEventSink | None = None,
        max_cached_blocks_per_namespace: int | None = None,
        num_tombstones: int = DEFAULT_NUM_TOMBSTONES,
        tier: KVTier | None = None,
    ) -> None:
        self.pool = block_pool
        self.block_size = block_pool.block_size
        self.tombstones = PrefixTombstones(num_tombstones)
        self.prefix_cache = (
            RadixCache(block_pool, kv_event_sink, max_cached_blocks_per_namespace, self.tombstones)
            if enable_prefix_cache
            else None
        )
        self.miss_tokens_by_reason: Counter[str] = Counter()  # prompt tokens not served
        self.num_cow_copies = 0  # copy-on-write copies, partial prefix blocks included
        self._pending_copies: list[BlockCopy] = []
        self._locked_nodes: dict[int, RadixNode] = {}  # seq_id -> node locked at admission
        self._num_offered_blocks: dict[int, int] = {}  # seq_id -> leading blocks in the tree
        self._admitted_cache_blocks: dict[int, list[int]] = {}  # seq_id -> tree blocks reused
        self._held: dict[str, list[int]] = {}  # holder -> blocks it references (auditor)
        self._quarantined: set[int] = set()  # found wrong, still referenced by someone
        self.num_quarantined_blocks = 0  # blocks ever quarantined
        self.tier_link: TierLink | None = None
        if tier is not None and self.prefix_cache is not None:
            self.tier_link = TierLink(tier)
            self.prefix_cache.evict_listener = self.tier_link.on_evict
            tier.set_pool_counter(self.num_cached_blocks_in)

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> BlockUsage:
        return self.pool.usage()

    @property
    def num_evictions(self) -> int:
        return self.prefix_cache.num_evictions if self.prefix_cache is not None else 0

    @property
    def is_prefix_caching(self) -> bool:
        """Whether admit() may reuse cached KV (the prefix cache is on)."""
        return self.prefix_cache is not None

    def cached_block_ids(self) -> list[int]:
        """Every block the prefix cache holds, sorted ([] with the cache off)."""
        return self.prefix_cache.tree_block_ids() if self.prefix_cache is not None else []

    def cached_block_hashes(self) -> list[int]:
        """The KV event hash of every cached block, sorted: what a subscriber that applied
        every event holds. A walk of the tree (a debug listing, not a per-step figure); [] with
        the cache off; raises KVEventsDisabled for a cache built without a kv_event_sink."""
        if self.prefix_cache is None:
            return []
        if not self.prefix_cache.is_recording_events:
            raise KVEventsDisabled("KV events are off: no block hashes are kept")
        return sorted(self.prefix_cache.block_hashes().values())

    def num_cached_blocks_in(self, namespace: Namespace) -> int:
        """Blocks the prefix tree holds for one namespace (0 with the cache off; no walk)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.num_blocks_in_namespace(namespace)

    def recent_cached_path(self) -> list[int]:
        """The blocks of the most recently used cached path, from position 0."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.recent_path_block_ids()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- allocation (admit() and insert_prefix(): PrefixSharing) ------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's next `num_new_tokens` slots exist and be writable; False if no room.

        Grows the block table to cover num_computed_tokens + num_new_tokens tokens. An
        existing block in the write range that is not writable (shared, or tree-owned) is
        replaced by a private copy: a BlockCopy(src, dst) is recorded and src loses seq's
        reference. Short of free blocks, it evicts cached ones first. On False nothing has
        changed (it evicts only when that makes enough room).
        """
        cow_indices, num_new_blocks = self._blocks_needed(seq, num_new_tokens)
        if not self._make_room(len(cow_indices) + num_new_blocks):
            return False
        for index in cow_indices:
            self._copy_on_write(seq, index)
        seq.block_ids.extend(self.pool.allocate() for _ in range(num_new_blocks))
        self._record_fill(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """The blocks allocate_slots(seq, num_new_tokens) would take now (copy-on-write
        copies and new blocks)."""
        cow_indices, num_new_blocks = self._blocks_needed(seq, num_new_tokens)
        return len(cow_indices) + num_new_blocks

    def slot_mapping(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """KV slots for positions num_computed_tokens .. + num_new_tokens - 1 of seq.

        Raises WriteViolation if any target block is shared or tree-owned: allocate_slots()
        must have made every target private, so a violation is a bug and never ignored.
        """
        slots = []
        start = seq.num_computed_tokens
        for position in range(start, start + num_new_tokens):
            index, offset = divmod(position, self.block_size)
            if index >= len(seq.block_ids):
                raise WriteViolation(
                    f"seq {seq.seq_id} writes position {position} beyond its block table "
                    f"{seq.block_ids}"
                )
            block_id = seq.block_ids[index]
            if not self.pool.is_writable(block_id):
                raise WriteViolation(
                    f"seq {seq.seq_id} would write block {block_id} (refcount "
                    f"{self.pool.refcount(block_id)}, tree-owned "
                    f"{self.pool.is_tree_owned(block_id)}) at position {position}",
                    block_id,
                )
            slots.append(block_id * self.block_size + offset)
        return slots

    def free_slots_past(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative tokens rejected: only seq's first num_tokens positions keep their KV.
        Releases the whole blocks past them (fresh private blocks of this step); stale slots
        in its last kept block are written again before anyone reads them."""
        num_blocks = self.num_blocks_for(num_tokens)
        for block_id in seq.block_ids[num_blocks:]:
            self._decref(block_id)
        del seq.block_ids[num_blocks:]
        if num_tokens % self.block_size:
            self.pool.set_num_tokens(seq.block_ids[-1], num_tokens % self.block_size)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's blocks: a copy of the block table, one more ref per block."""
        assert not child.block_ids, f"child seq {child.seq_id} already holds blocks"
        for block_id in parent.block_ids:
            self.pool.incref(block_id)
        child.block_ids = list(parent.block_ids)
        if parent.seq_id in self._num_offered_blocks:
            self._num_offered_blocks[child.seq_id] = self._num_offered_blocks[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference on every block of its table and its tree lock. Safe to call
        again. Blocks the tree holds stay cached (evictable once no one holds them)."""
        for block_id in seq.block_ids:
            self._decref(block_id)
        seq.block_ids = []
        self._unlock(seq)
        self._num_offered_blocks.pop(seq.seq_id, None)
        self._admitted_cache_blocks.pop(seq.seq_id, None)
        if self.tier_link is not None:
            self.tier_link.forget(seq.seq_id)

    def take_block_copies(self) -> list[BlockCopy]:
        """Copies recorded since the last call, in order.

        Apply them in order or as one gather-then-scatter: a block is a src only while it is
        still held, so it can become a dst (after being freed) only later in the list.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks cached blocks no sequence holds or locks (LRU leaves first)."""
        return self.prefix_cache.evict(num_blocks) if self.prefix_cache is not None else []

    # -- other holders and quarantine ---------------------------------------------------------
    def hold_blocks(self, holder: str, block_ids: list[int]) -> bool:
        """One more reference on each block for `holder`, until release_blocks(holder).
        False (nothing held) if one of them is free: there is nothing left to hold."""
        if any(self.pool.refcount(block_id) == 0 for block_id in block_ids):
            return False
        for block_id in block_ids:
            self.pool.incref(block_id)
        self._held.setdefault(holder, []).extend(block_ids)
        return True

    def allocate_held_blocks(
        self, holder: str, num_tokens: int, num_spare_blocks: int = 0
    ) -> list[int] | None:
        """Fresh private blocks for num_tokens tokens, held by `holder` (never cached: the tree
        only takes blocks from insert_prefix). Evicts cached blocks if needed; None (nothing
        changed) unless num_spare_blocks free or evictable blocks would remain besides."""
        num_blocks = self.num_blocks_for(num_tokens)
        if self._num_available_blocks(num_blocks + num_spare_blocks) < 0:
            return None
        self._make_room(num_blocks)  # the holder reads what this spills (take_block_spills)
        block_ids = [self.pool.allocate() for _ in range(num_blocks)]
        for index, block_id in enumerate(block_ids):
            num_filled = min(self.block_size, num_tokens - index * self.block_size)
            self.pool.set_num_tokens(block_id, num_filled)
        self._held.setdefault(holder, []).extend(block_ids)
        return block_ids

    def release_blocks(self, holder: str) -> None:
        """Drop every reference `holder` took. Safe to call again."""
        for block_id in self._held.pop(holder, []):
            self._decref(block_id)

    def quarantine(self, block_ids: list[int]) -> list[int]:
        """Take blocks found wrong out of the prefix tree, with everything cached after them
        (computed from them), so that no new request can match them. Returns the blocks newly
        taken out (counted in num_quarantined_blocks); those still referenced stay marked:
        sequences holding them go on but never insert them (see the module docstring)."""
        newly: list[int] = []
        for block_id in block_ids:
            if block_id in self._quarantined or block_id in newly:
                continue
            self._record_quarantine_tombstone(block_id)
            dropped = self.prefix_cache.invalidate(block_id) if self.prefix_cache else []
            if not dropped and self.pool.refcount(block_id) == 0:
                continue  # neither cached nor held: nothing left to keep out
            for dropped_id in dict.fromkeys([block_id, *dropped]):
                newly.append(dropped_id)
                if self.pool.refcount(dropped_id) > 0:  # someone still reads it
                    self._quarantined.add(dropped_id)
        self.num_quarantined_blocks += len(newly)
        return newly

    def _record_quarantine_tombstone(self, block_id: int) -> None:
        if self.prefix_cache is not None and self.pool.is_tree_owned(block_id):
            cache = self.prefix_cache
            namespace = cache.namespace_of_block(block_id)
            prefix = cache.block_prefix_token_ids(block_id)
            self.tombstones.record(namespace, prefix, MissReason.QUARANTINED)
            if self.tier_link is not None:  # nor may it, or what follows it, come back
                self.tier_link.tier.invalidate(namespace, prefix)

    def is_quarantined(self, block_id: int) -> bool:
        return block_id in self._quarantined

    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        """Refcount of every block == live block-table references + tree reference; the
        tree agrees with the pool; locks and insert records belong to live sequences
        (engine/kv/kv_integrity.py)."""
        kv_integrity.check_integrity(self, list(live_seqs))

    def num_leaked_blocks(self, live_seqs: Iterable[Sequence]) -> int:
        """sum(refcounts) - references held by live sequences, other holders and the tree
        (must be 0). O(live sequences): the pool keeps its sums as blocks change."""
        held = sum(len(seq.block_ids) for seq in live_seqs)
        held += sum(len(block_ids) for block_ids in self._held.values())
        return self.pool.total_refcount() - held - self.pool.num_tree_owned_blocks

    # -- helpers ----------------------------------------------------------------------------
    def _num_trusted_blocks(self, seq: Sequence, num_blocks: int) -> int:
        """num_blocks, cut before seq's first quarantined block."""
        if self._quarantined:
            for index, block_id in enumerate(seq.block_ids[:num_blocks]):
                if block_id in self._quarantined:
                    return index
        return num_blocks

    def _decref(self, block_id: int) -> None:
        if self.pool.decref(block_id) == 0:
            self._quarantined.discard(block_id)

    def _num_available_blocks(self, num_blocks: int) -> int:
        """Free blocks (+ evictable ones when short) minus num_blocks; >= 0: it fits."""
        num_spare = self.pool.num_free_blocks - num_blocks
        if num_spare >= 0 or self.prefix_cache is None:
            return num_spare
        return num_spare + self.prefix_cache.num_evictable_blocks()

    def _make_room(self, num_blocks: int) -> bool:
        """Ensure num_blocks free blocks, evicting cached ones only if that is enough."""
        if self._num_available_blocks(num_blocks) < 0:
            return False
        shortfall = num_blocks - self.pool.num_free_blocks
        if shortfall > 0:
            assert self.prefix_cache is not None
            freed = self.prefix_cache.evict(shortfall)
            assert len(freed) == shortfall, f"evicted {len(freed)} of {shortfall} blocks"
        return True

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], int]:
        """(table indices needing copy-on-write, number of blocks to append)."""
        first_index = seq.num_computed_tokens // self.block_size
        end_index = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        existing_end = min(end_index, len(seq.block_ids))
        cow_indices = [
            index
            for index in range(first_index, existing_end)
            if not self.pool.is_writable(seq.block_ids[index])
        ]
        return cow_indices, max(0, end_index - len(seq.block_ids))

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        src = seq.block_ids[index]
        dst = self.pool.allocate()
        self.pool.set_num_tokens(dst, self.pool.num_tokens(src))
        self._pending_copies.append(BlockCopy(src=src, dst=dst))
        self.num_cow_copies += 1
        self._decref(src)
        seq.block_ids[index] = dst

    def _record_fill(self, seq: Sequence, num_tokens: int) -> None:
        first_index = seq.num_computed_tokens // self.block_size
        for index in range(first_index, self.num_blocks_for(num_tokens)):
            filled = min(self.block_size, num_tokens - index * self.block_size)
            self.pool.set_num_tokens(seq.block_ids[index], filled)
