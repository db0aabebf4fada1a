"""One step's SchedulerOutput while the Scheduler builds it (torch-free).

The Scheduler decides which sequences get how many tokens and reserves their KV slots; the
StepBuilder lays each chunk out as a ScheduledSeq with its slot mapping, advances the
sequence's num_computed_tokens and keeps what is left of the step's token budget.

Write audit: a chunk whose slot mapping would write into a shared or cached block is left out
of the step and kept in `violations`, for the Scheduler to fail its request.

Fair share: with a PrefillCap, a prefill chunk also stays within its tenant's limit there
(engine/sched/fair_share.py); decodes never do.
"""

from __future__ import annotations

from engine.core.batch import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence
from engine.kv.kv_cache_manager import KVCacheManager, WriteViolation
from engine.sched.fair_share import PrefillCap


class StepBuilder:
    """The SchedulerOutput being built and what is left of the step's token budget.

    Made afresh by every schedule(); reads KV memory through KVCacheManager.slot_mapping
    only. The tallies (num_preempted, num_prefill_tokens) are this step's alone.
    """

    def __init__(
        self, kv_cache_manager: KVCacheManager, budget: int, prefill_cap: PrefillCap | None = None
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.budget = budget  # tokens the step may still schedule
        self.prefill_cap = prefill_cap  # fair share, two or more tenants active: else None
        self.output = SchedulerOutput()
        self.scheduled_ids: set[int] = set()  # scheduled, or left out by the write audit
        self.num_preempted = 0  # sequences preempted to make room this step
        self.num_prefill_tokens = 0  # tokens scheduled in prefill chunks
        self.violations: list[tuple[Sequence, WriteViolation]] = []

    def prefill_budget(self, tenant: str) -> int:
        """The most tokens a prefill chunk of `tenant` may take now."""
        limit = self.prefill_cap.limit(tenant) if self.prefill_cap is not None else None
        return self.budget if limit is None else min(self.budget, limit)

    def num_spare_tokens(self) -> int:
        """What other work (the cache audit) may still compute in this step: the budget left,
        within the prefill cap (an audit recomputes a prompt like a prefill)."""
        if self.prefill_cap is None:
            return self.budget
        return min(self.budget, self.prefill_cap.num_tokens_left)

    def add_chunk(self, seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> None:
        """Schedule seq's next num_tokens positions, whose slots are already allocated: its
        own tokens, then `draft` (whose positions count as computed until update_from_output
        keeps or gives them back)."""
        assert num_tokens >= 1
        draft = draft or []
        try:
            slots = self.kv_cache_manager.slot_mapping(seq, num_tokens)
        except WriteViolation as violation:  # not scheduled; its request fails after admission
            self.violations.append((seq, violation))
            self.scheduled_ids.add(seq.seq_id)
            return
        start = seq.num_computed_tokens
        is_prefill = not seq.is_decoding
        end = start + num_tokens
        own_end = end - len(draft)
        is_last = own_end == seq.num_tokens and not seq.is_prompt_only
        self.output.seqs.append(
            ScheduledSeq(
                seq.seq_id,
                seq.token_slice(start, own_end) + draft,
                start,
                list(seq.block_ids),
                seq.sample_spec() if is_last else None,
                seq.prompt_logprobs_spec(start, end),
                draft,
                seq.num_prompt_tokens,
            )
        )
        self.output.slot_mapping.extend(slots)
        seq.num_computed_tokens = end
        self.budget -= num_tokens
        self.scheduled_ids.add(seq.seq_id)
        if is_prefill:
            self.num_prefill_tokens += num_tokens
            if self.prefill_cap is not None:
                self.prefill_cap.take(num_tokens)
