"""The one facade the scheduler uses for KV memory (torch-free).

It hides the block pool (and, later, the radix prefix cache): the scheduler asks for slots,
forks and frees sequences, and never touches refcounts or free lists itself.

References: a live sequence holds one reference on every block of its block table; the
prefix tree (not built yet) holds one on each block it owns. check_integrity() verifies that
the pool's refcounts are exactly those references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.batch import BlockCopy
from engine.block_pool import BlockPool, BlockUsage
from engine.sequence import Sequence


class WriteViolation(RuntimeError):
    """A slot mapping would write into a block another holder can read (invariant 2)."""


class KVCacheManager:
    """Block tables of sequences over a shared BlockPool, with copy-on-write.

    Contract: allocate_slots() before slot_mapping(); both for the same num_new_tokens, with
    seq.num_computed_tokens unchanged in between. Block copies recorded by allocate_slots()
    are drained by take_block_copies() and must reach the runner before that step's forward.
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self.pool = block_pool
        self.block_size = block_pool.block_size
        self.num_cow_copies = 0
        self._pending_copies: list[BlockCopy] = []

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

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate_slots(seq, num_new_tokens) would succeed now."""
        cow_indices, num_new_blocks = self._blocks_needed(seq, num_new_tokens)
        return len(cow_indices) + num_new_blocks <= self.pool.num_free_blocks

    # -- allocation -------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's next `num_new_tokens` slots exist and be writable; False if no room.

        Grows the block table to cover num_computed_tokens + num_new_tokens tokens. An
        existing block in the write range that is not writable (shared, or tree-owned) is
        replaced by a private copy: a BlockCopy(src, dst) is recorded and src loses seq's
        reference. On False nothing has changed.
        """
        cow_indices, num_new_blocks = self._blocks_needed(seq, num_new_tokens)
        if len(cow_indices) + num_new_blocks > self.pool.num_free_blocks:
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
                    f"{self.pool.is_tree_owned(block_id)}) at position {position}"
                )
            slots.append(block_id * self.block_size + offset)
        return slots

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's blocks: a copy of the block table, one more ref per block."""
        assert not child.block_ids, f"child seq {child.seq_id} already holds blocks"
        for block_id in parent.block_ids:
            self.pool.incref(block_id)
        child.block_ids = list(parent.block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference on every block of its table. Safe to call again."""
        for block_id in seq.block_ids:
            self.pool.decref(block_id)
        seq.block_ids = []

    def take_block_copies(self) -> list[BlockCopy]:
        """Copies recorded since the last call, in order.

        Apply them in order or as one gather-then-scatter: a block is a src only while it is
        still held, so it can become a dst (after being freed) only later in the list.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- prefix cache hooks (no-ops until the radix cache exists) --------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Prefix cache hook, on admission: reuse cached blocks for seq's leading tokens.

        Will set seq.block_ids / num_computed_tokens from the radix tree match and return
        the number of tokens found. No prefix cache yet: finds nothing.
        """
        del seq
        return 0

    def insert_prefix(self, seq: Sequence) -> None:
        """Prefix cache hook, after a computed chunk and at finish: offer full blocks to
        the radix tree. No prefix cache yet: nothing to do."""
        del seq

    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        """Refcount of every block == live block-table references + tree reference."""
        self.pool.check_integrity()
        held = self._references(live_seqs)
        for block_id in range(self.pool.num_blocks):
            expected = held[block_id] + int(self.pool.is_tree_owned(block_id))
            actual = self.pool.refcount(block_id)
            assert actual == expected, (
                f"block {block_id}: refcount {actual} but {held[block_id]} sequence "
                f"reference(s) and tree-owned {self.pool.is_tree_owned(block_id)}"
            )

    def num_leaked_blocks(self, live_seqs: Iterable[Sequence]) -> int:
        """sum(refcounts) - references held by live sequences and the tree (must be 0)."""
        held = sum(self._references(live_seqs).values())
        tree = sum(self.pool.is_tree_owned(b) for b in range(self.pool.num_blocks))
        return self.pool.total_refcount() - held - tree

    # -- helpers ----------------------------------------------------------------------------
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
        self.pool.decref(src)
        seq.block_ids[index] = dst

    def _record_fill(self, seq: Sequence, num_tokens: int) -> None:
        first_index = seq.num_computed_tokens // self.block_size
        for index in range(first_index, self.num_blocks_for(num_tokens)):
            filled = min(self.block_size, num_tokens - index * self.block_size)
            self.pool.set_num_tokens(seq.block_ids[index], filled)

    def _references(self, live_seqs: Iterable[Sequence]) -> Counter[int]:
        held: Counter[int] = Counter()
        for seq in live_seqs:
            assert len(set(seq.block_ids)) == len(seq.block_ids), (
                f"seq {seq.seq_id} lists a block twice: {seq.block_ids}"
            )
            held.update(seq.block_ids)
        return held
