"""Async scheduling: the next decode step scheduled while the last one runs (torch-free).

On a GPU the host need not wait for a step's sampled tokens before it schedules the next one:
when every sequence of the step in flight is a plain decode, the next step is the same
sequences decoding once more, each reading, on the device, the token the step in flight
samples for it (SchedulerOutput.previous_token_rows). Until that token is known, the sequence
holds PLACEHOLDER_TOKEN as its last output token and counts its position as computed, so the
block table and slot mapping cover it like any decode's.

update_from_output() for the step in flight first rewinds those sequences to what schedule()
would have left (placeholder dropped, position not computed), applies the tokens as in a
synchronous step (stop checks, prefix cache, charges), then counts the position as computed
again for the sequences still running. A sequence that stopped on the token loses its
lookahead row: the row's KV write lands in a block it no longer holds, ahead of any later
step's use of that block (one stream), and the row's token is dropped (its sequence is gone).

The outputs allow a lookahead only where the synchronous schedule would run exactly these
decodes and nothing the pending token changes is read on the host: no waiting request that
has a seat, counting the seats the step in flight frees for certain (with every seat taken a
backlog waits either way; a seat an EOS frees is filled by the schedule() after the
lookahead, one step later), no running sequence outside the step, no speculative drafts (a
step of that many decodes may not draft: speculative_max_decodes; one that an EOS leaves
smaller and might draft decodes without one, the same text), one draw per row, no grammar,
no penalty over the output tokens. A sequence that the pending token finishes for certain
(max_tokens, the context window) is left out. The blocks the step takes must be free ones:
where the pool would have to evict cached blocks (second-tier spills, a host wait on a GPU)
or preempt, the synchronous schedule() decides, as it would have without async scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.batch import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.request_table import RequestTable
from engine.sched.step_builder import StepBuilder


def is_plain_decode(scheduled: ScheduledSeq) -> bool:
    """One token drawn from the row, with nothing read from the host's output tokens."""
    spec = scheduled.sample
    if spec is None or scheduled.draft_token_ids or len(spec.seeds) != 1:
        return False
    params = spec.sampling_params
    return (
        spec.grammar_keys is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


class Lookahead:
    """The sequences of the lookahead step in flight (at most one step: every lookahead is
    applied by the update_from_output() of the step before it, which rewinds them first)."""

    def __init__(
        self,
        table: RequestTable,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.table = table
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seqs: list[Sequence] = []

    def candidates(
        self, previous: SchedulerOutput, drafts_among: Callable[[int], bool]
    ) -> list[tuple[int, Sequence]]:
        """(row of `previous`, sequence) of each decode the step after `previous` repeats,
        where that step is those decodes whatever `previous` samples; [] where it is not.
        drafts_among(n): whether a step of n decodes may carry speculative drafts."""
        if self.seqs or not previous.seqs or previous.num_decodes != len(previous.seqs):
            return []
        scheduled_ids = {scheduled.seq_id for scheduled in previous.seqs}
        if any(seq.seq_id not in scheduled_ids for seq in self.table.running):
            return []
        if not all(is_plain_decode(scheduled) for scheduled in previous.seqs):
            return []
        live = [
            (row, seq)
            for row, seq in enumerate(self.table.seqs.get(s.seq_id) for s in previous.seqs)
            if seq is not None
        ]
        going_on = [(row, seq) for row, seq in live if self._goes_on(seq)]
        if not going_on or drafts_among(len(going_on)):
            return []
        if self._may_admit(num_freed_seats=len(live) - len(going_on)):
            return []
        manager = self.kv_cache_manager
        num_blocks = sum(manager.num_blocks_to_allocate(seq, 1) for _, seq in going_on)
        return going_on if num_blocks <= manager.num_free_blocks else []

    def _may_admit(self, num_freed_seats: int) -> bool:
        """Whether the schedule() after the step in flight could take a waiting sequence:
        one with a seat, counting those of the sequences the step finishes for certain (to
        admit it), or one the pool can never hold (to refuse it; _can_never_fit)."""
        waiting = self.table.waiting
        if not waiting:
            return False
        free_seats = self.max_num_seqs - self.table.num_seats + num_freed_seats
        if free_seats > 0 and any(seq.num_choices <= free_seats for seq in waiting):
            return True
        num_total_blocks = self.kv_cache_manager.num_total_blocks
        return any(
            self.kv_cache_manager.num_blocks_for(seq.num_tokens) > num_total_blocks
            or seq.num_choices > self.max_num_seqs
            for seq in waiting
        )

    def build(self, candidates: list[tuple[int, Sequence]], step: StepBuilder) -> list[int]:
        """Add the candidates' decodes, each on a placeholder; the rows of the step in flight
        their tokens come from."""
        rows = []
        for row, seq in candidates:
            if step.budget == 0:
                break
            assert seq.num_computed_tokens == seq.num_tokens, f"seq {seq.seq_id} is not in flight"
            seq.output_token_ids.append(PLACEHOLDER_TOKEN)
            added = False
            try:
                added = self._add(seq, step)
            finally:
                if not added:  # also where it raised: no placeholder stays behind
                    seq.output_token_ids.pop()
            if added:
                rows.append(row)
        return rows

    def _add(self, seq: Sequence, step: StepBuilder) -> bool:
        """seq's decode on its placeholder, where its slot is allocated and writable."""
        if not self.kv_cache_manager.allocate_slots(seq, 1):
            return False  # allows() counted free blocks: not expected, but it can wait
        num_violations = len(step.violations)
        step.add_chunk(seq, 1)
        if len(step.violations) > num_violations:  # its request fails with the step
            return False
        self.seqs.append(seq)
        return True

    def _goes_on(self, seq: Sequence) -> bool:
        """Running, and not finished for certain by the token in flight (max_tokens, the
        context window: Sequence.check_stop)."""
        return (
            seq.status is SequenceStatus.RUNNING
            and seq.num_output_tokens + 1 < seq.sampling_params.max_tokens
            and seq.num_tokens + 1 < self.max_model_len
        )

    def rewind(self) -> list[Sequence]:
        """Put the lookahead's live sequences back as schedule() left them (the placeholder
        dropped, its position not computed) and forget the lookahead; returns them."""
        seqs, self.seqs = self.seqs, []
        live = [seq for seq in seqs if seq.status is SequenceStatus.RUNNING]
        for seq in live:
            assert seq.output_token_ids[-1] == PLACEHOLDER_TOKEN, f"seq {seq.seq_id}"
            seq.output_token_ids.pop()
            seq.num_computed_tokens -= 1
        return live

    @staticmethod
    def advance(seqs: list[Sequence]) -> None:
        """After the update: the lookahead's sequences still running count its position as
        computed again (its step is in flight)."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += 1
