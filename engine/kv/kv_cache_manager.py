"""The one facade the scheduler uses for KV memory (torch-free).

It hides the block pool and the radix prefix cache: the scheduler admits, grows, forks and
frees sequences, and never touches refcounts, free lists or tree nodes itself.

References: a live sequence holds one reference on every block of its block table; the
prefix tree holds one on each block it owns. check_integrity() verifies that the pool's
refcounts are exactly those references. A sequence admitted with a cached prefix also holds
one lock on the tree node its match ended in, until its first chunk is computed (the block
copy it needed is done by then) or it is freed. Other holders (the cache auditor) take
references through hold_blocks() / allocate_held_blocks() and drop them with release_blocks();
they count as references like a sequence's.

Quarantine: quarantine() drops blocks found wrong from the tree; a sequence that still holds
one keeps reading it, but insert_prefix() never offers that block, nor any block after it in
the sequence's table (their KV was computed from it), to the tree again. A quarantined block
leaves the quarantine when its last reference goes (its next owner writes fresh KV).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.core.batch import BlockCopy
from engine.core.errors import KVEventsDisabled
from engine.core.intmath import cdiv
from engine.core.protocol import CacheDiagnosis
from engine.core.sequence import Sequence
from engine.kv.block_pool import BlockPool, BlockUsage
from engine.kv.cache_diagnosis import (
    DEFAULT_NUM_TOMBSTONES,
    MissReason,
    PrefixTombstones,
    classify,
    make_diagnosis,
    miss_block_end,
)
from engine.kv.kv_events import KVEventSink
from engine.kv.radix_cache import RadixCache
from engine.kv.radix_node import MatchResult, Namespace, RadixNode


class WriteViolation(RuntimeError):
    """A slot mapping would write into a block another holder can read (invariant 2).

    block_id: the block it would write (None when the position lies past the block table).
    """

    def __init__(self, message: str, block_id: int | None = None) -> None:
        super().__init__(message)
        self.block_id = block_id


class KVCacheManager:
    """Block tables of sequences over a shared BlockPool, with copy-on-write.

    Contract: admit() (a waiting sequence) or allocate_slots() (a running one) before
    slot_mapping(); both for the same num_new_tokens, with seq.num_computed_tokens unchanged
    in between. Block copies recorded by admit() / allocate_slots() are drained by
    take_block_copies() and must reach the runner before that step's forward.

    With enable_prefix_cache, a RadixCache over the same pool (`prefix_cache`) shares KV
    between sequences of one namespace; when free blocks run short, allocation evicts
    unlocked cached blocks (LRU) before it reports failure. Without it, prefix_cache is None
    and admit() reuses nothing. kv_event_sink (with the cache on) receives the cache's KV events
    (engine/kv/kv_events.py) on the engine thread; None (the default) records nothing.
    max_cached_blocks_per_namespace caps each namespace (tenant) under pressure: once one holds
    more tree blocks than that, its least recently used ones are evicted before anyone else's
    (engine/kv/namespace_quota.py); None: plain LRU over all namespaces.

    `pool` and `prefix_cache` are exposed for tests and checks; the scheduler, admission and
    the auditor use the methods below only. Every figure here is O(1) or O(live sequences):
    none walks the pool or the tree (check_integrity() does, to recount them).
    """

    def __init__(
        self,
        block_pool: BlockPool,
        enable_prefix_cache: bool = False,
        kv_event_sink: KVEventSink | None = None,
        max_cached_blocks_per_namespace: int | None = None,
        num_tombstones: int = DEFAULT_NUM_TOMBSTONES,
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

    # -- allocation -------------------------------------------------------------------------
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
        Releases the whole blocks of its table past them (fresh private blocks of this step);
        the stale slots past num_tokens in its last kept block are written again before
        anyone reads them."""
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

    def take_block_copies(self) -> list[BlockCopy]:
        """Copies recorded since the last call, in order.

        Apply them in order or as one gather-then-scatter: a block is a src only while it is
        still held, so it can become a dst (after being freed) only later in the list.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- prefix cache ---------------------------------------------------------------------
    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many of seq's tokens admit() would reuse right now (0 without the cache).

        A lookup only: takes no references (it refreshes the LRU time of what it finds).
        """
        match = self._match(seq)
        return match.num_matched_tokens if match is not None else 0

    def admit(self, seq: Sequence, token_budget: int) -> int | None:
        """Give a waiting seq (no blocks, nothing computed) its cached prefix and the slots of
        its first chunk; returns the chunk's token count, or None (nothing changed) when the
        pool cannot hold it even after evicting.

        Reuse: seq's known tokens (prompt, plus outputs after a preemption) are matched with
        a cap of seq.num_reusable_tokens (num_tokens - 1, so at least one token is computed
        and yields logits; fewer while prompt positions are owed logits for scoring). Full
        cached blocks are shared (one more reference each, listed in the block table). A
        match ending inside a block gets a fresh private block and a BlockCopy(src=cached
        block, dst=new): only its first num_partial_tokens slots matter, the rest will be
        overwritten. The matched tree node stays locked (its partial block cannot be
        evicted) until the chunk is computed (insert_prefix) or seq is freed. When the
        pool is too tight to keep the copy's source as well, only the full blocks are
        reused. num_computed_tokens becomes the reused token count; then
        min(uncomputed, token_budget) slots are allocated.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0 and token_budget >= 1
        match = self._match(seq)
        if match is not None and match.last_node is not None:
            self._share_full_blocks(seq, match)
        use_partial = match is not None and match.partial_block_id is not None
        if use_partial and not self._make_room_to_admit(
            seq, match.num_partial_tokens, token_budget
        ):
            use_partial = False  # its source is pinned: the chunk may fit without the copy
            self._unlock(seq)
        if not use_partial and not self._make_room_to_admit(seq, 0, token_budget):
            self.free(seq)
            seq.num_computed_tokens = 0
            return None
        if use_partial:
            self._copy_partial_block(seq, match)
        num_new_tokens = min(seq.num_uncomputed_tokens, token_budget)
        is_allocated = self.allocate_slots(seq, num_new_tokens)
        assert is_allocated, f"seq {seq.seq_id}: room was made but allocation failed"
        return num_new_tokens

    def insert_prefix(self, seq: Sequence) -> None:
        """Offer seq's full, computed blocks to the prefix tree; call after every computed
        chunk (the runner has written it) and at finish. Never for KV that may be wrong
        (a failed step). Also ends the admission lock: the partial block is copied by now.

        A block the tree takes becomes tree-owned: read-only from then on (full blocks are
        never written again). Where the tree already holds the same tokens in another block,
        seq switches to the tree's block and drops its duplicate.
        """
        self._unlock(seq)
        if self.prefix_cache is None:
            return
        num_full_blocks = self._num_trusted_blocks(seq, seq.num_computed_tokens // self.block_size)
        num_offered = self._num_offered_blocks.get(seq.seq_id, 0)
        if num_full_blocks <= num_offered:
            return
        token_ids = seq.token_slice(0, num_full_blocks * self.block_size)
        block_ids = seq.block_ids[:num_full_blocks]
        num_taken = self.prefix_cache.insert(seq.cache_namespace, token_ids, block_ids)
        self._count_stored_prompt(seq, num_full_blocks, num_taken)
        if num_taken < num_full_blocks - num_offered:
            self._adopt_tree_blocks(seq, token_ids, num_offered)
        self._num_offered_blocks[seq.seq_id] = num_full_blocks

    def _count_stored_prompt(self, seq: Sequence, num_full_blocks: int, num_taken: int) -> None:
        """Add to seq.num_stored_prompt_tokens the prompt positions the tree just took from it:
        the tree takes a suffix of the blocks offered (past what it held); positions the cache
        served (num_cached_tokens, a copied partial block's too) or counted before (a block
        stored again after a preemption) are not new."""
        end = min(num_full_blocks * self.block_size, seq.num_prompt_tokens)
        first_taken = (num_full_blocks - num_taken) * self.block_size
        first_new = max(first_taken, seq.num_cached_tokens, seq.stored_prompt_end)
        seq.num_stored_prompt_tokens += max(0, end - first_new)
        seq.stored_prompt_end = max(seq.stored_prompt_end, end)

    def diagnose(self, seq: Sequence) -> CacheDiagnosis:
        """Why seq's prompt missed the cache; call once, right after its first admission
        (seq.num_computed_tokens is then what the cache served). Counts the prompt tokens
        not served under the reason. Takes no references and changes no LRU order."""
        num_prompt, num_matched = seq.num_prompt_tokens, seq.num_computed_tokens
        num_reusable = seq.num_reusable_tokens
        is_cacheable = self.prefix_cache is not None and seq.sampling_params.prompt_logprobs is None
        dropped, elsewhere = None, False
        if is_cacheable and num_matched < num_reusable:
            dropped, elsewhere = self._dropped_or_elsewhere(seq, num_matched)
        reason = classify(
            num_prompt, num_reusable, num_matched, self.block_size, dropped, elsewhere, is_cacheable
        )
        if reason == MissReason.DIVERGED and num_matched < seq.num_volatile_prefix_tokens:
            reason = MissReason.VOLATILE_PREFIX
        self.miss_tokens_by_reason[reason] += num_prompt - num_matched
        return make_diagnosis(num_prompt, num_matched, self.block_size, reason)

    def _dropped_or_elsewhere(self, seq: Sequence, num_matched: int) -> tuple:
        end = miss_block_end(num_matched, self.block_size)
        prompt = seq.prompt_token_ids
        dropped = None
        if end <= len(prompt):
            dropped = self.tombstones.reason_for(seq.cache_namespace, prompt[:end])
        elsewhere = num_matched == 0 and self.prefix_cache.holds_first_block_elsewhere(
            seq.cache_namespace, prompt
        )
        return dropped, elsewhere

    def take_admitted_cache_blocks(self, seq: Sequence) -> list[int]:
        """The tree blocks admit() reused for seq, in order: its shared full blocks, then the
        source of its copied partial block, if any ([] without a hit). Forgotten once taken."""
        return self._admitted_cache_blocks.pop(seq.seq_id, [])

    def num_inserted_tokens(self, seq: Sequence) -> int:
        """Leading tokens of seq whose blocks the tree holds (matched or inserted by seq)."""
        return self._num_offered_blocks.get(seq.seq_id, 0) * self.block_size

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
        self._make_room(num_blocks)
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

    def is_quarantined(self, block_id: int) -> bool:
        return block_id in self._quarantined

    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        """Refcount of every block == live block-table references + tree reference; the
        tree agrees with the pool; locks and insert records belong to live sequences."""
        live_seqs = list(live_seqs)
        self.pool.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        live_ids = {seq.seq_id for seq in live_seqs}
        assert set(self._locked_nodes) <= live_ids, "a finished sequence still holds a lock"
        assert set(self._num_offered_blocks) <= live_ids, "insert record of a finished seq"
        for block_id in self._quarantined:
            assert self.pool.refcount(block_id) > 0, f"quarantined block {block_id} is free"
            assert not self.pool.is_tree_owned(block_id), f"quarantined block {block_id} cached"
        assert all(node.num_own_locks > 0 for node in self._locked_nodes.values())
        held = self._references(live_seqs)
        for block_id in range(self.pool.num_blocks):
            expected = held[block_id] + int(self.pool.is_tree_owned(block_id))
            actual = self.pool.refcount(block_id)
            assert actual == expected, (
                f"block {block_id}: refcount {actual} but {held[block_id]} sequence "
                f"reference(s) and tree-owned {self.pool.is_tree_owned(block_id)}"
            )

    def num_leaked_blocks(self, live_seqs: Iterable[Sequence]) -> int:
        """sum(refcounts) - references held by live sequences, other holders and the tree
        (must be 0). O(live sequences): the pool keeps its sums as blocks change."""
        held = sum(len(seq.block_ids) for seq in live_seqs)
        held += sum(len(block_ids) for block_ids in self._held.values())
        return self.pool.total_refcount() - held - self.pool.num_tree_owned_blocks

    # -- helpers ----------------------------------------------------------------------------
    def _match(self, seq: Sequence) -> MatchResult | None:
        if self.prefix_cache is None:
            return None
        token_ids = seq.token_ids()
        return self.prefix_cache.match(seq.cache_namespace, token_ids, seq.num_reusable_tokens)

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

    def _unlock(self, seq: Sequence) -> None:
        node = self._locked_nodes.pop(seq.seq_id, None)
        if node is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.unlock(node)

    def _share_full_blocks(self, seq: Sequence, match: MatchResult) -> None:
        """Lock the match (its partial block must survive until copied), then share."""
        assert self.prefix_cache is not None and match.last_node is not None
        self.prefix_cache.lock(match.last_node)
        self._locked_nodes[seq.seq_id] = match.last_node
        for block_id in match.full_block_ids:
            self.pool.incref(block_id)
        seq.block_ids.extend(match.full_block_ids)
        seq.num_computed_tokens = len(match.full_block_ids) * self.block_size
        self._num_offered_blocks[seq.seq_id] = len(match.full_block_ids)
        self._admitted_cache_blocks[seq.seq_id] = list(match.full_block_ids)

    def _copy_partial_block(self, seq: Sequence, match: MatchResult) -> None:
        assert match.partial_block_id is not None
        dst = self.pool.allocate()
        self.pool.set_num_tokens(dst, match.num_partial_tokens)
        self._pending_copies.append(BlockCopy(src=match.partial_block_id, dst=dst))
        self.num_cow_copies += 1
        seq.block_ids.append(dst)
        seq.num_computed_tokens += match.num_partial_tokens
        self._admitted_cache_blocks.setdefault(seq.seq_id, []).append(match.partial_block_id)

    def _adopt_tree_blocks(self, seq: Sequence, token_ids: list[int], start: int) -> None:
        """Switch seq's blocks from index `start` on to the tree's blocks for the same tokens
        (where it computed a duplicate), freeing the duplicates seq alone held."""
        assert self.prefix_cache is not None
        match = self.prefix_cache.match(seq.cache_namespace, token_ids)
        assert match.num_matched_tokens == len(token_ids), "inserted tokens are not cached"
        for index in range(start, len(match.full_block_ids)):
            tree_block_id, own_block_id = match.full_block_ids[index], seq.block_ids[index]
            if tree_block_id != own_block_id:
                self.pool.incref(tree_block_id)
                self._decref(own_block_id)
                seq.block_ids[index] = tree_block_id

    def _num_available_blocks(self, num_blocks: int) -> int:
        """Free blocks (+ evictable ones when short) minus num_blocks; >= 0: it fits."""
        num_spare = self.pool.num_free_blocks - num_blocks
        if num_spare >= 0 or self.prefix_cache is None:
            return num_spare
        return num_spare + self.prefix_cache.num_evictable_blocks()

    def _make_room_to_admit(self, seq: Sequence, num_partial_tokens: int, budget: int) -> bool:
        """Room for seq's first chunk after its shared blocks (+ the partial copy)."""
        num_cached = seq.num_computed_tokens + num_partial_tokens
        num_new_tokens = min(seq.num_tokens - num_cached, budget)
        return self._make_room(
            self.num_blocks_for(num_cached + num_new_tokens) - len(seq.block_ids)
        )

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

    def _references(self, live_seqs: Iterable[Sequence]) -> Counter[int]:
        held: Counter[int] = Counter()
        for block_ids in self._held.values():
            held.update(block_ids)
        for seq in live_seqs:
            assert len(set(seq.block_ids)) == len(seq.block_ids), (
                f"seq {seq.seq_id} lists a block twice: {seq.block_ids}"
            )
            held.update(seq.block_ids)
        return held
