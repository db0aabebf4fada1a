"""Physical KV blocks: a free list and a refcount per block (torch-free).

Who holds a reference: each live sequence whose block table lists the block holds one,
and the prefix tree holds one for every block it owns (`is_tree_owned`). The pool does not
know the holders; KVCacheManager / RadixCache keep their own records and check_integrity()
of the manager compares the sums.

Every figure (blocks by state, filled slots, total refcount) is kept up to date as blocks
change state, so usage() and the leak count cost the same for 1k blocks as for 100k; only
check_integrity() walks the pool, and it recounts each figure from scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CachedListener = Callable[[int, bool], None]


class NoFreeBlocksError(RuntimeError):
    """allocate() on an empty pool; callers check num_free_blocks first."""


@dataclass(frozen=True)
class BlockUsage:
    num_total_blocks: int
    num_free_blocks: int
    num_private_blocks: int  # refcount 1, not owned by the tree
    num_shared_blocks: int  # refcount > 1
    num_cached_blocks: int  # refcount 1 and owned by the tree (only the tree holds it)
    fragmentation_ratio: float  # unused slots in allocated blocks / allocated slots
    usage_watermark: float  # peak fraction held by sequences since start (cached blocks excluded)


class BlockPool:
    """N blocks of block_size token slots. Block ids are 0..N-1.

    allocate() hands out a block with refcount 1 (a fresh, private block);
    incref/decref walk the same path back; a block returns to the free list when its
    refcount reaches 0. Freed blocks are reused oldest-freed first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        self._num_tokens = [0] * num_blocks  # filled slots, for fragmentation
        self._tree_owned = [False] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        # Tree-owned blocks with refcount 1: evictable on demand, so not "used" by requests.
        self._num_cached = 0
        self._num_shared = 0  # refcount > 1
        self._num_tree_owned = 0
        self._num_filled_tokens = 0  # filled slots over all allocated blocks
        self._total_refcount = 0
        self._peak_used = 0
        self._cached_listener: CachedListener | None = None

    def set_cached_listener(self, listener: CachedListener | None) -> None:
        """listener(block_id, is_cached) runs whenever a block starts or stops being cached
        (tree-owned with refcount 1): the radix cache keeps its evictable count with it.
        One listener per pool (one RadixCache per pool)."""
        assert listener is None or self._cached_listener is None, "the pool has a listener"
        self._cached_listener = listener

    def _set_cached(self, block_id: int, is_cached: bool) -> None:
        self._num_cached += 1 if is_cached else -1
        if self._cached_listener is not None:
            self._cached_listener(block_id, is_cached)

    # -- allocation -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def allocate(self) -> int:
        if not self._free_ids:
            raise NoFreeBlocksError("no free KV blocks")
        block_id = self._free_ids.popleft()
        assert self._refcounts[block_id] == 0, f"block {block_id} on the free list is in use"
        self._refcounts[block_id] = 1
        self._total_refcount += 1
        self._num_tokens[block_id] = 0
        self._note_peak()
        return block_id

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks held by sequences: allocated minus those only the prefix tree holds."""
        return self.num_used_blocks - self._num_cached

    def _note_peak(self) -> None:
        self._peak_used = max(self._peak_used, self.num_blocks_in_use)

    def incref(self, block_id: int) -> int:
        assert self._refcounts[block_id] > 0, f"incref of free block {block_id}"
        refcount = self._refcounts[block_id] + 1
        self._refcounts[block_id] = refcount
        self._total_refcount += 1
        if refcount == 2:
            self._num_shared += 1
            if self._tree_owned[block_id]:
                self._set_cached(block_id, False)  # a request took a cached block back into use
                self._note_peak()
        return refcount

    def decref(self, block_id: int) -> int:
        """Drop one reference; at 0 the block is free again. Returns the new refcount."""
        refcount = self._refcounts[block_id]
        assert refcount > 0, f"decref of free block {block_id}"
        refcount -= 1
        self._refcounts[block_id] = refcount
        self._total_refcount -= 1
        if refcount == 1:
            self._num_shared -= 1
            if self._tree_owned[block_id]:
                self._set_cached(block_id, True)
        if refcount == 0:
            assert not self._tree_owned[block_id], f"block {block_id} freed while tree-owned"
            self._num_filled_tokens -= self._num_tokens[block_id]
            self._num_tokens[block_id] = 0
            self._free_ids.append(block_id)
        return refcount

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    # -- ownership and fill -------------------------------------------------------------
    def set_tree_owned(self, block_id: int, owned: bool) -> None:
        assert self._refcounts[block_id] > 0, f"tree ownership of free block {block_id}"
        if owned == self._tree_owned[block_id]:
            return
        self._tree_owned[block_id] = owned
        self._num_tree_owned += 1 if owned else -1
        if self._refcounts[block_id] == 1:
            self._set_cached(block_id, owned)

    def is_tree_owned(self, block_id: int) -> bool:
        return self._tree_owned[block_id]

    def is_writable(self, block_id: int) -> bool:
        """Only a block held by exactly one sequence and not by the tree may be written."""
        return self._refcounts[block_id] == 1 and not self._tree_owned[block_id]

    def set_num_tokens(self, block_id: int, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self.block_size
        assert self._refcounts[block_id] > 0, f"fill of free block {block_id}"
        self._num_filled_tokens += num_tokens - self._num_tokens[block_id]
        self._num_tokens[block_id] = num_tokens

    def num_tokens(self, block_id: int) -> int:
        return self._num_tokens[block_id]

    # -- figures and checks -------------------------------------------------------------
    def usage(self) -> BlockUsage:
        """Blocks by state and the fill figures, from the counters (no walk of the pool)."""
        used = self.num_used_blocks
        allocated_slots = used * self.block_size
        unused_slots = allocated_slots - self._num_filled_tokens
        return BlockUsage(
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_private_blocks=used - self._num_shared - self._num_cached,
            num_shared_blocks=self._num_shared,
            num_cached_blocks=self._num_cached,
            fragmentation_ratio=unused_slots / allocated_slots if used else 0.0,
            usage_watermark=self._peak_used / self.num_blocks,
        )

    def total_refcount(self) -> int:
        return self._total_refcount

    @property
    def num_tree_owned_blocks(self) -> int:
        return self._num_tree_owned

    def check_integrity(self) -> None:
        """Free list and refcounts agree: free <=> refcount 0, no duplicates, no tree owner."""
        free = set(self._free_ids)
        assert len(free) == len(self._free_ids), "duplicate block on the free list"
        for block_id, refcount in enumerate(self._refcounts):
            assert refcount >= 0, f"block {block_id} has refcount {refcount}"
            is_free = block_id in free
            assert is_free == (refcount == 0), (
                f"block {block_id}: refcount {refcount} but on free list: {is_free}"
            )
            assert not (is_free and self._tree_owned[block_id]), f"free block {block_id} tree-owned"
        self._check_counters()

    def _check_counters(self) -> None:
        """Every running figure equals a recount from scratch."""
        refcounts, owned = self._refcounts, self._tree_owned
        recount = {
            "cached": sum(1 for b, r in enumerate(refcounts) if r == 1 and owned[b]),
            "shared": sum(1 for r in refcounts if r > 1),
            "tree-owned": sum(owned),
            "filled": sum(n for n, r in zip(self._num_tokens, refcounts, strict=True) if r),
            "refcount": sum(refcounts),
        }
        kept = {
            "cached": self._num_cached,
            "shared": self._num_shared,
            "tree-owned": self._num_tree_owned,
            "filled": self._num_filled_tokens,
            "refcount": self._total_refcount,
        }
        assert kept == recount, f"pool counters {kept} != recount {recount}"
