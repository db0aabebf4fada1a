"""The prefix cache's link to the second KV tier (torch-free): what the pool evicts is spilled
into the tier, and an admission whose prompt continues past the pool's match into the tier
loads those blocks back instead of computing them (engine/kv/kv_tier.py holds the tier).

Spills. RadixCache.evict() reports each block it frees with its namespace and token path; a
block the tier does not hold yet becomes a BlockSpill of the step. The runner reads every spill
out of the pool first thing in the step (before loads, copies and the forward can write the
block again) and returns the bytes; store_spilled() hands them to the tier. The auditor, which
takes private blocks after the step and writes them at once, reads its own spills right after
taking them (engine/audit/auditor.py).

Loads. An admission (PrefixSharing._restore_from_tier), after the pool's full blocks are shared
and before a partial block is copied, asks for the tier's
consecutive blocks after them are read and verified now (each failed entry is dropped; the
prompt is computed from there), loaded into fresh pool blocks by BlockLoads of this step, and
inserted into the prefix tree at once, so they are read-only and shared like any cached block.
With read-ahead (KVTier.read_ahead, on in a served engine), an admission that would load waits
while a reader thread reads and checks those entries (engine/kv/tier_reads.py): the sequence
stays waiting, the others step on, and the next admission finds them read. Without it they are
read within the admission, on the engine thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.core.batch import BlockLoad, BlockSpill
from engine.kv.kv_tier import KVTier
from engine.kv.radix_cache import RadixCache
from engine.kv.tier_reads import ReadAhead, fetch


class TierLink:
    """Pending transfers of the current step and per-sequence restore counts."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier
        self.read_ahead = ReadAhead(tier.store) if tier.read_ahead else None
        self._spills: list[BlockSpill] = []
        self._loads: list[BlockLoad] = []
        self._restored_tokens: dict[int, int] = {}  # seq_id -> tokens loaded at admission
        self.num_spills_lost = 0  # spilled blocks whose bytes never came back (failed steps)

    def on_evict(self, namespace: Hashable, token_ids: Sequence[int], block_id: int) -> None:
        if not self.tier.contains(namespace, token_ids, touch=True):
            self._spills.append(BlockSpill(block_id, namespace, tuple(token_ids)))

    def take_spills(self) -> list[BlockSpill]:
        spills, self._spills = self._spills, []
        return spills

    def take_loads(self) -> list[BlockLoad]:
        loads, self._loads = self._loads, []
        return loads

    def store_spilled(self, spills: list[BlockSpill], payloads: list[bytes]) -> None:
        """The bytes the runner read for this step's spills (none when the step failed)."""
        if len(payloads) != len(spills):
            self.num_spills_lost += len(spills)
            return
        for spill, payload in zip(spills, payloads, strict=True):
            self.tier.add(spill.namespace, spill.token_ids, payload)

    def unsaved_cached_blocks(self, cache: RadixCache) -> list[BlockSpill]:
        """The prefix tree's blocks the tier does not hold, least recently used first: what a
        graceful stop writes (the runner reads them, store_spilled() adds them)."""
        return [
            BlockSpill(block_id, namespace, tuple(token_ids))
            for namespace, token_ids, block_id in cache.cached_paths()
            if not self.tier.contains(namespace, token_ids)
        ]

    def num_restorable_blocks(
        self, namespace: Hashable, token_ids: Sequence[int], first_block: int, max_blocks: int
    ) -> int:
        return self.tier.match(namespace, token_ids, first_block, max_blocks) if max_blocks else 0

    def is_read(
        self,
        seq_id: int,
        namespace: Hashable,
        token_ids: Sequence[int],
        first_block: int,
        max_blocks: int,
    ) -> bool:
        """With read-ahead: whether the tier blocks seq would load (from first_block on) have
        been read; starts reading them when not. True without read-ahead or tier blocks."""
        if self.read_ahead is None or max_blocks <= 0:
            return True
        located = self.tier.locate(namespace, token_ids, first_block, max_blocks)
        return not located or self.read_ahead.poll(seq_id, located)

    def load(
        self,
        seq_id: int,
        namespace: Hashable,
        token_ids: Sequence[int],
        first_block: int,
        num_blocks: int,
    ) -> list[bytes]:
        """The verified payloads of those blocks: what the reader thread read for seq when it
        read exactly them, else read here."""
        located = self.tier.locate(namespace, token_ids, first_block, num_blocks)
        read = self.read_ahead.take(seq_id, located) if self.read_ahead is not None else None
        return self.tier.accept(namespace, read or fetch(self.tier.store, located))

    def wait_for_reads(self, timeout_s: float) -> None:
        """Block up to timeout_s for a read in flight (when the engine has nothing else)."""
        if self.read_ahead is not None:
            self.read_ahead.wait_any(timeout_s)

    @property
    def num_reads_in_flight(self) -> int:
        return self.read_ahead.num_in_flight if self.read_ahead is not None else 0

    def add_load(self, block_id: int, payload: bytes) -> None:
        self._loads.append(BlockLoad(block_id, payload))

    def record_restored(self, seq_id: int, num_tokens: int) -> None:
        self._restored_tokens[seq_id] = self._restored_tokens.get(seq_id, 0) + num_tokens

    def take_restored_tokens(self, seq_id: int) -> int:
        return self._restored_tokens.pop(seq_id, 0)

    def forget(self, seq_id: int) -> None:
        self._restored_tokens.pop(seq_id, None)
        if self.read_ahead is not None:
            self.read_ahead.forget(seq_id)

    def close(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.close()
