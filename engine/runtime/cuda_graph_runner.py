"""CUDA graphs for decode-only steps: capture the model's forward once, replay it each step.

A decode step launches ~15 small kernels per layer; at small batches launching them from
Python costs more than running them. A CUDA graph records the launches once and replays
them with one call. A graph fixes every shape, pointer and host-side value, so:

- batches are padded up to the next captured size. Padding rows get token 0 at position 0,
  slot -1 (store_kv skips it: no real KV is ever written) and seq_len 0 (the decode kernel
  writes zeros for them and reads no block);
- inputs live in static buffers that each step overwrites in place (DecodeBuffers);
- block tables have a fixed width: enough blocks for max_model_len. They stay on the device
  between steps: a step writes only the entries that changed (a sequence's new block, a
  copy-on-write swap, a row that now holds another sequence), not the whole table;
- the decode kernel's split-K count is baked in, so each batch size is captured once per
  split count the Triton backend can choose for it, and a replay takes the graph of the
  count the backend chooses for the step, as an eager step of that batch size would.

A graph also records the LM head and greedy argmax over its rows, into static logits and
greedy buffers shared by every graph: a greedy step then reads B token ids back, its only host
sync, and a sampled one reads the logits without running the head again.

Only the Triton backend can be captured (the torch reference loops over host ints); prefill
and mixed steps run eagerly. Sizes, padding, row building and the static buffers are plain
code that runs on any device; only capture() and replay() need CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.core.batch import SchedulerOutput
from engine.core.intmath import cdiv
from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.transfer import stage

if TYPE_CHECKING:  # imported lazily at run time: the module imports triton
    from engine.runtime.attention.triton_backend import TritonBackend

logger = logging.getLogger(__name__)

# (largest size, step): 1, 2, 4, then every 8 up to 32, every 16 up to 512. Larger decode
# batches run eagerly: they are compute-bound, launch overhead no longer matters.
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEPS = ((32, 8), (512, 16))
MAX_CAPTURE_SIZE = _SIZE_STEPS[-1][0]
_PADDING_SLOT = -1  # store_kv skips slots < 0
_MIB = float(1 << 20)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
    min(max_num_seqs, MAX_CAPTURE_SIZE), which is always included itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {size for size in _SMALL_SIZES if size <= largest}
    start = 0
    for limit, step in _SIZE_STEPS:
        sizes.update(range(start + step, min(limit, largest) + 1, step))
        start = limit
    sizes.add(largest)
    return sorted(sizes)


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds num_seqs rows; None if none does."""
    at = bisect.bisect_left(sizes, num_seqs)
    return sizes[at] if at < len(sizes) else None


def graphs_disabled_reason(
    enforce_eager: bool, device: torch.device, attention_backend: str
) -> str | None:
    """Why decode steps cannot use CUDA graphs here, or None when they can."""
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if enforce_eager:
        return "enforce_eager is set"
    if attention_backend != "triton":
        return f"attention backend {attention_backend!r} cannot be captured (only triton)"
    return None


@dataclass
class DecodeRows:
    """One decode step's inputs as host ints, padded to batch_size rows (row i = sequence i)."""

    input_ids: list[int]  # [Bp], 0 in padding rows
    positions: list[int]  # [Bp], 0 in padding rows
    slot_mapping: list[int]  # [Bp], -1 in padding rows
    seq_lens: list[int]  # [Bp] context length after the step, 0 in padding rows
    tables: list[list[int]]  # [B] each sequence's blocks that its context covers
    max_seq_len: int

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def table_width(self) -> int:
        """The most blocks a row reads this step."""
        return max(map(len, self.tables))


def build_decode_rows(sched_out: SchedulerOutput, batch_size: int, block_size: int) -> DecodeRows:
    """Flatten a decode-only step (one token per sequence) into rows padded to batch_size.

    Each block table is cut to the blocks its context covers (what the kernels read).
    Raises ValueError if a sequence has other than one token, the slot mapping does not have
    one slot per sequence, a table is too short for its context, or batch_size is too small.
    """
    seqs = sched_out.seqs
    num_padding = batch_size - len(seqs)
    if not seqs or num_padding < 0:
        raise ValueError(f"cannot pad {len(seqs)} sequences to a batch of {batch_size}")
    if len(sched_out.slot_mapping) != len(seqs) or any(s.num_tokens != 1 for s in seqs):
        raise ValueError("a decode-only step needs exactly one token and one slot per sequence")
    seq_lens = [seq.context_len for seq in seqs]
    tables = []
    for seq, seq_len in zip(seqs, seq_lens, strict=True):
        count = cdiv(seq_len, block_size)
        if len(seq.block_ids) < count:
            raise ValueError(
                f"sequence {seq.seq_id} has {len(seq.block_ids)} blocks "
                f"for {seq.context_len} tokens"
            )
        tables.append(seq.block_ids[:count])
    padding = [0] * num_padding
    return DecodeRows(
        input_ids=[seq.token_ids[0] for seq in seqs] + padding,
        positions=[seq.start_pos for seq in seqs] + padding,
        slot_mapping=[*sched_out.slot_mapping, *([_PADDING_SLOT] * num_padding)],
        seq_lens=seq_lens + padding,
        tables=tables,
        max_seq_len=max(seq_lens),
    )


class DecodeBuffers:
    """The static inputs of every decode graph: the graph of batch size B reads rows [:B].

    input_ids, positions, slot_mapping: [max_batch_size] int64; seq_lens: [max_batch_size]
    int32; block_tables: [max_batch_size, max_blocks_per_seq] int32; query_start_loc:
    [max_batch_size + 1] int32, always 0, 1, 2, ... (one query token per row).
    Fresh buffers hold padding values everywhere, so running on them writes no KV.

    The block tables live on the device across steps; `held` mirrors what each row's leading
    entries hold there, so a step sends only the entries that differ (table_writes counts them).
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        longs = {"dtype": torch.int64, "device": device}
        ints = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(max_batch_size, **longs)
        self.positions = torch.zeros(max_batch_size, **longs)
        self.slot_mapping = torch.full((max_batch_size,), _PADDING_SLOT, **longs)
        self.seq_lens = torch.zeros(max_batch_size, **ints)
        self.block_tables = torch.zeros(max_batch_size, max_blocks_per_seq, **ints)
        self.query_start_loc = torch.arange(max_batch_size + 1, **ints)
        self.held: list[list[int]] = [[] for _ in range(max_batch_size)]
        self.table_writes = 0  # block-table entries the last load() sent

    def load(self, rows: DecodeRows) -> None:
        """Overwrite rows [:rows.batch_size] in place, from pinned memory without a sync on CUDA;
        of the block tables, only the entries that changed.

        Table entries past a row's table keep ids of earlier steps, and padding rows keep
        theirs: the kernels read a row's table only up to its seq_len, which never reaches them.
        """
        size, width = rows.batch_size, rows.table_width
        if size > self.max_batch_size or width > self.max_blocks_per_seq:
            raise ValueError(
                f"{size} rows x {width} blocks do not fit buffers of "
                f"{self.max_batch_size} x {self.max_blocks_per_seq}"
            )
        at, block_ids = self._table_updates(rows.tables)
        # Pinned staging: the copies into the static buffers below do not block the host.
        long_values = [*rows.input_ids, *rows.positions, *rows.slot_mapping, *at]
        longs = stage(long_values, torch.int64, self.device)
        ints = stage([*rows.seq_lens, *block_ids], torch.int32, self.device)
        self.input_ids[:size].copy_(longs[:size], non_blocking=True)
        self.positions[:size].copy_(longs[size : 2 * size], non_blocking=True)
        self.slot_mapping[:size].copy_(longs[2 * size : 3 * size], non_blocking=True)
        self.seq_lens[:size].copy_(ints[:size], non_blocking=True)
        if at:
            where = longs[3 * size :].to(self.device, non_blocking=True)
            entries = ints[size:].to(self.device, non_blocking=True)
            self.block_tables.view(-1).index_copy_(0, where, entries)
        self.table_writes = len(at)

    def _table_updates(self, tables: list[list[int]]) -> tuple[list[int], list[int]]:
        """(flat positions, block ids) of the entries where `tables` differ from what the
        rows hold: from each row's first difference to its end (a decoding sequence gains a
        block every block_size steps; copy-on-write swaps its last one)."""
        at: list[int] = []
        block_ids: list[int] = []
        for row, table in enumerate(tables):
            held = self.held[row]
            if held == table:
                continue
            start = len(held) if table[: len(held)] == held else _common_prefix(held, table)
            base = row * self.max_blocks_per_seq
            at += range(base + start, base + len(table))
            block_ids += table[start:]
            self.held[row] = table
        return at, block_ids

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """AttentionMetadata over rows [:batch_size], every tensor a view of the buffers.

        The host lists only carry the row count (num_seqs); their values are placeholders,
        which the Triton backend does not read. max_seq_len is an upper bound.
        """
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            num_decodes=batch_size,
            max_seq_len=max_seq_len,
            max_query_len=1,
            query_start_loc_host=list(range(batch_size + 1)),
            seq_lens_host=[max_seq_len] * batch_size,
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading entries a and b share."""
    pairs = zip(a, b, strict=False)  # the shorter one's length at most
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


class CudaGraphRunner:
    """Captures the decode forward per (batch size, split count) and replays it.

    Owns the static input buffers, the graphs and their outputs. The model, the KV pool and
    `attn_backend` are borrowed: they must outlive the runner and keep their storage (the
    graphs hold raw pointers to them). replay() returns a view of a static output that the
    next replay overwrites: consume it (logits, sampling) before the next step.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: KVCaches,
        attn_backend: TritonBackend,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = kv_caches[0][0].device
        self.num_kv_heads = kv_caches[0][0].shape[2]
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks_per_seq, self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # [B, E] per graph
        # [max B, V] float32 and [max B] int64, written by every graph (run_static); None
        # until the first run, or for a model without an LM head (the tests' stand-ins)
        self.logits: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None
        self.num_replays = 0
        self._fixed_backends: dict[int, TritonBackend] = {}

    def split_counts(self, batch_size: int) -> list[int]:
        """Every split count attn_backend may choose for batch_size rows: powers of two up to
        its choice at max_model_len (the choice grows with the context, never past it)."""
        most = self.attn_backend.choose_num_splits(
            batch_size, self.num_kv_heads, self.max_model_len, self.device
        )
        return [1 << i for i in range(most.bit_length())]

    def can_replay(self, sched_out: SchedulerOutput) -> bool:
        """Whether this step is decode-only and small enough for a captured graph."""
        num_seqs = len(sched_out.seqs)
        return bool(self.graphs) and 0 < num_seqs == sched_out.num_decodes <= self.sizes[-1]

    def load(self, sched_out: SchedulerOutput) -> tuple[int, int]:
        """Fill the static buffers for a decode-only step; the (batch size, split count) to run."""
        batch_size = padded_size(len(sched_out.seqs), self.sizes)
        if batch_size is None:
            raise ValueError(f"{len(sched_out.seqs)} sequences exceed the largest graph")
        rows = build_decode_rows(sched_out, batch_size, self.block_size)
        self.buffers.load(rows)
        num_splits = self.attn_backend.choose_num_splits(
            batch_size, self.num_kv_heads, rows.max_seq_len, self.device
        )
        return batch_size, num_splits

    def replay(
        self, sched_out: SchedulerOutput, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run a decode-only step (can_replay() holds): hidden states [B, E], row i = seq i.
        tokens: a lookahead step's input tokens on the device, for its first rows (their
        token_ids hold placeholders), copied in after the host's values."""
        key = self.load(sched_out)
        if tokens is not None:
            self.buffers.input_ids[: tokens.shape[0]].copy_(tokens)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][: len(sched_out.seqs)]

    def head_outputs(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last replay's logits [num_rows, V] (float32) and greedy tokens [num_rows]
        (their argmax): views that the next replay overwrites. None without a head."""
        if self.logits is None or self.greedy is None:
            return None
        return self.logits[:num_rows], self.greedy[:num_rows]

    def run_static(self, batch_size: int, num_splits: int) -> torch.Tensor:
        """What a graph records: the model over rows [:batch_size] of the buffers, then its LM
        head and greedy argmax into the static logits and greedy rows: hidden [B, E]."""
        buffers = self.buffers
        hidden = self.model(
            buffers.input_ids[:batch_size],
            buffers.positions[:batch_size],
            buffers.metadata(batch_size, self.max_model_len),
            self.kv_caches,
            self._fixed_backend(num_splits),
        )
        compute_logits = getattr(self.model, "compute_logits", None)
        if compute_logits is not None:
            logits = compute_logits(hidden)  # [B, V] float32
            if self.logits is None:  # the first (eager) run allocates, outside any capture
                rows = self.buffers.max_batch_size
                self.logits = logits.new_empty((rows, logits.shape[1]))
                self.greedy = torch.zeros(rows, dtype=torch.int64, device=logits.device)
            self.logits[:batch_size].copy_(logits)
            self.greedy[:batch_size].copy_(logits.argmax(dim=-1))
        return hidden

    def capture(self) -> None:
        """Record every (batch size, split count) graph; needs CUDA and takes seconds.

        Largest batches first: the graphs share one memory pool, and each smaller one fits in
        what the larger ones left free. The buffers hold padding while capturing, so the
        eager warm-up run before each capture (it compiles the kernels) writes no KV.
        """
        started = time.monotonic()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for batch_size in reversed(self.sizes):
                for num_splits in self.split_counts(batch_size):
                    self._capture_one(batch_size, num_splits, pool)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info(
            "CUDA graphs: %d captured for decode batch sizes %s in %.1fs (%.0f MiB)",
            len(self.graphs),
            self.sizes,
            time.monotonic() - started,
            (free_before - free_after) / _MIB,
        )

    def _capture_one(self, batch_size: int, num_splits: int, pool: tuple[int, int]) -> None:
        self.run_static(batch_size, num_splits)  # warm-up: compile outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[(batch_size, num_splits)] = self.run_static(batch_size, num_splits)
        self.graphs[(batch_size, num_splits)] = graph

    def _fixed_backend(self, num_splits: int) -> TritonBackend:
        if num_splits not in self._fixed_backends:
            from engine.runtime.attention.triton_backend import TritonBackend

            self._fixed_backends[num_splits] = TritonBackend(num_splits=num_splits)
        return self._fixed_backends[num_splits]
