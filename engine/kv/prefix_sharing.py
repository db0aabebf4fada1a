"""KVCacheManager's prefix-cache half (torch-free): admit a sequence with its cached prefix (from
the pool, and from the second tier when there is one), offer its computed blocks back to the
tree, say why a prompt missed, and hand the step's second-tier transfers over.

The base class of KVCacheManager (engine/kv/kv_cache_manager.py), never used alone: it works on
the manager's pool, tree and block tables (the attributes declared below) and calls the block
operations the manager provides (the abstract methods). Engine thread only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter

from engine.core.batch import BlockCopy, BlockLoad, BlockSpill
from engine.core.protocol import CacheDiagnosis
from engine.core.sequence import Sequence
from engine.kv.block_pool import BlockPool
from engine.kv.cache_diagnosis import (
    MissReason,
    PrefixTombstones,
    classify,
    make_diagnosis,
    miss_block_end,
)
from engine.kv.radix_cache import RadixCache
from engine.kv.radix_node import MatchResult, RadixNode
from engine.kv.tier_link import TierLink


class PrefixSharing(ABC):
    """Admission with a cached prefix, insertion of computed blocks, miss diagnosis.

    Per sequence it records the tree node its admission locked, how many of its leading
    blocks the tree holds (matched or inserted) and which tree blocks its admission reused.
    """

    pool: BlockPool
    block_size: int
    prefix_cache: RadixCache | None
    tombstones: PrefixTombstones
    miss_tokens_by_reason: Counter[str]
    num_cow_copies: int
    _pending_copies: list[BlockCopy]
    _locked_nodes: dict[int, RadixNode]  # seq_id -> node locked at admission
    _num_offered_blocks: dict[int, int]  # seq_id -> leading blocks in the tree
    _admitted_cache_blocks: dict[int, list[int]]  # seq_id -> tree blocks reused
    tier_link: TierLink | None  # the second tier, when there is one
    _quarantined: set[int]  # found wrong (or never written), still referenced by someone

    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many of seq's tokens admit() would reuse right now (0 without the cache).
        A lookup only: takes no references (it refreshes the LRU time of what it finds)."""
        match = self._match(seq)
        return match.num_matched_tokens if match is not None else 0

    def admit(self, seq: Sequence, token_budget: int) -> int | None:
        """Give a waiting seq (no blocks, nothing computed) its cached prefix and the slots of
        its first chunk; returns the chunk's token count, or None (nothing changed) when the
        pool cannot hold it even after evicting, or 0 (nothing changed) while the second
        tier's blocks it would load are being read on the reader thread (it waits; the step
        admits others).

        Up to seq.num_reusable_tokens known tokens are matched (at least one is left to compute
        and yield logits). Full cached blocks are shared; with a second tier, its blocks that
        continue the match are loaded into fresh blocks and cached (_restore_from_tier). A
        match ending inside a block gets a private copy of it (a BlockCopy), and its tree node
        stays locked until insert_prefix() or free(). When the pool cannot also keep the copy's
        source, only full blocks are reused. num_computed_tokens becomes the reused count; then
        min(uncomputed, token_budget) slots are allocated.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0 and token_budget >= 1
        match = self._match(seq)
        if match is not None and not self._tier_blocks_read(seq, match):
            return 0  # its tier blocks are being read: it waits, nothing changed
        if match is not None and match.last_node is not None:
            self._share_full_blocks(seq, match)
        use_partial = match is not None and match.partial_block_id is not None
        if match is not None and self._restore_from_tier(seq, token_budget):
            use_partial = False  # the tier's whole blocks go further than the partial block
        elif seq.seq_id not in self._locked_nodes:
            use_partial = False  # the tier let the partial block go, then loaded nothing
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
        """Offer seq's full, computed blocks to the tree; call after every computed chunk and
        at finish, never for KV that may be wrong (a failed step). Ends the admission lock.

        A block the tree takes becomes tree-owned (read-only); where the tree already holds
        the same tokens, seq switches to the tree's block and drops its duplicate.
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

    def take_admitted_cache_blocks(self, seq: Sequence) -> list[int]:
        """The tree blocks admit() reused for seq, in order: its shared full blocks, then the
        source of its copied partial block, if any ([] without a hit). Forgotten once taken."""
        return self._admitted_cache_blocks.pop(seq.seq_id, [])

    def num_inserted_tokens(self, seq: Sequence) -> int:
        """Leading tokens of seq whose blocks the tree holds (matched or inserted by seq)."""
        return self._num_offered_blocks.get(seq.seq_id, 0) * self.block_size

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

    def _tier_blocks_read(self, seq: Sequence, match: MatchResult) -> bool:
        """Whether the tier blocks seq's admission would load are read (see admit)."""
        if self.tier_link is None:
            return True
        first = len(match.full_block_ids)
        max_blocks = seq.num_reusable_tokens // self.block_size - first
        return self.tier_link.is_read(
            seq.seq_id, seq.cache_namespace, seq.token_ids(), first, max_blocks
        )

    def _restore_from_tier(self, seq: Sequence, token_budget: int) -> bool:
        """Load the second tier's blocks that continue seq's shared blocks (verified; a failed
        entry ends the run) into fresh blocks, insert them in the tree and share them; as many
        as the pool has room for beside the first chunk. False (nothing changed) when the tier
        holds none or there is no room for one."""
        link = self.tier_link
        if link is None:
            return False
        bs = self.block_size
        first = len(seq.block_ids)
        token_ids = seq.token_ids()
        max_blocks = seq.num_reusable_tokens // bs - first
        num_blocks = link.num_restorable_blocks(seq.cache_namespace, token_ids, first, max_blocks)
        if num_blocks > 0:
            # The match's lock kept its partial block (and the node's blocks after it) from
            # eviction; the tier's blocks replace that block, and loading may need the room.
            self._unlock(seq)
        # As many as the pool can hold with the first chunk now (computing the rest needs only
        # a chunk's blocks at a time; loading needs them all at once).
        while (
            num_blocks > 0
            and self._num_available_blocks(
                self._num_blocks_to_admit(seq, num_blocks * bs, token_budget)
            )
            < 0
        ):
            num_blocks -= 1
        if num_blocks <= 0 or not self._make_room_to_admit(seq, num_blocks * bs, token_budget):
            return False
        payloads = link.load(seq.seq_id, seq.cache_namespace, token_ids, first, num_blocks)
        if not payloads:
            return False
        for payload in payloads:
            block_id = self.pool.allocate()
            self.pool.set_num_tokens(block_id, bs)
            link.add_load(block_id, payload)
            seq.block_ids.append(block_id)
        num_blocks = len(seq.block_ids)
        cached = token_ids[: num_blocks * bs]
        assert self.prefix_cache is not None
        if self.prefix_cache.insert(seq.cache_namespace, cached, seq.block_ids) < len(payloads):
            self._adopt_tree_blocks(seq, cached, first)
        seq.num_computed_tokens = num_blocks * bs
        self._num_offered_blocks[seq.seq_id] = num_blocks
        self._admitted_cache_blocks[seq.seq_id] = list(seq.block_ids)
        link.record_restored(seq.seq_id, len(payloads) * bs)
        return True

    # -- second-tier transfers (the step's spills and loads, engine/kv/tier_link.py) ---------
    def take_block_spills(self) -> list[BlockSpill]:
        """Blocks evicted since the last call that the second tier wants ([] without one)."""
        return self.tier_link.take_spills() if self.tier_link is not None else []

    def take_block_loads(self) -> list[BlockLoad]:
        """Second-tier blocks admitted since the last call, to write before the copies."""
        return self.tier_link.take_loads() if self.tier_link is not None else []

    def store_spilled(self, spills: list[BlockSpill], payloads: list[bytes]) -> None:
        """The runner's bytes for a step's spills go to the tier."""
        if self.tier_link is not None and spills:
            self.tier_link.store_spilled(spills, payloads)

    def drop_unwritten(self, loads: list[BlockLoad]) -> None:
        """A step failed before its tier loads were surely written: those blocks, and what is
        cached after them, leave the tree; holders keep them but never insert them again."""
        for load in loads:
            if self.prefix_cache is None:
                return
            for block_id in [load.block_id, *self.prefix_cache.invalidate(load.block_id)]:
                if self.pool.refcount(block_id) > 0:
                    self._quarantined.add(block_id)

    def wait_for_tier_reads(self, timeout_s: float) -> None:
        """Block up to timeout_s while second-tier reads are in flight (an idle step's wait)."""
        if self.tier_link is not None:
            self.tier_link.wait_for_reads(timeout_s)

    def drop_pending_transfers(self) -> None:
        """A schedule() that failed: its loads never run (their blocks leave the tree, as in
        drop_unwritten) and its spills are lost."""
        self.store_spilled(self.take_block_spills(), [])
        self.drop_unwritten(self.take_block_loads())

    def unsaved_cached_blocks(self) -> list[BlockSpill]:
        """Cached blocks the second tier lacks, least recently used first ([] without one)."""
        if self.tier_link is None or self.prefix_cache is None:
            return []
        return self.tier_link.unsaved_cached_blocks(self.prefix_cache)

    def take_restored_tokens(self, seq: Sequence) -> int:
        """Tokens of seq's last admission that came from the second tier (then forgotten)."""
        return self.tier_link.take_restored_tokens(seq.seq_id) if self.tier_link else 0

    # -- helpers ----------------------------------------------------------------------------
    def _match(self, seq: Sequence) -> MatchResult | None:
        if self.prefix_cache is None:
            return None
        token_ids = seq.token_ids()
        return self.prefix_cache.match(seq.cache_namespace, token_ids, seq.num_reusable_tokens)

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
        """A private block for the match's partial block: only its first num_partial_tokens
        slots are copied; the rest will be overwritten."""
        assert match.partial_block_id is not None
        dst = self.pool.allocate()
        self.pool.set_num_tokens(dst, match.num_partial_tokens)
        self._pending_copies.append(BlockCopy(src=match.partial_block_id, dst=dst))
        self.num_cow_copies += 1
        seq.block_ids.append(dst)
        seq.num_computed_tokens += match.num_partial_tokens
        self._admitted_cache_blocks.setdefault(seq.seq_id, []).append(match.partial_block_id)

    def _make_room_to_admit(self, seq: Sequence, num_partial_tokens: int, budget: int) -> bool:
        """Room for seq's first chunk after its shared blocks (+ the partial copy, or the
        tokens loaded from the second tier)."""
        return self._make_room(self._num_blocks_to_admit(seq, num_partial_tokens, budget))

    def _num_blocks_to_admit(self, seq: Sequence, num_extra_cached: int, budget: int) -> int:
        """New blocks seq's admission takes: num_extra_cached tokens after its shared blocks,
        then its first chunk."""
        num_cached = seq.num_computed_tokens + num_extra_cached
        num_new_tokens = min(seq.num_tokens - num_cached, budget)
        return self.num_blocks_for(num_cached + num_new_tokens) - len(seq.block_ids)

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

    def _count_stored_prompt(self, seq: Sequence, num_full_blocks: int, num_taken: int) -> None:
        """Add to seq.num_stored_prompt_tokens the prompt positions the tree just took (a
        suffix of the blocks offered); positions the cache served or counted before are not
        new."""
        end = min(num_full_blocks * self.block_size, seq.num_prompt_tokens)
        first_taken = (num_full_blocks - num_taken) * self.block_size
        first_new = max(first_taken, seq.num_cached_tokens, seq.stored_prompt_end)
        seq.num_stored_prompt_tokens += max(0, end - first_new)
        seq.stored_prompt_end = max(seq.stored_prompt_end, end)

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

    # -- provided by KVCacheManager ----------------------------------------------------------
    @abstractmethod
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool: ...

    @abstractmethod
    def free(self, seq: Sequence) -> None: ...

    @abstractmethod
    def num_blocks_for(self, num_tokens: int) -> int: ...

    @abstractmethod
    def _make_room(self, num_blocks: int) -> bool: ...

    @abstractmethod
    def _num_available_blocks(self, num_blocks: int) -> int: ...

    @abstractmethod
    def _decref(self, block_id: int) -> None: ...

    @abstractmethod
    def _num_trusted_blocks(self, seq: Sequence, num_blocks: int) -> int: ...
