"""The admission phase of a scheduler step (torch-free): waiting sequences admitted under the
step's budget, the seats and the pool, in AdmissionPolicy's order (engine/sched/admission.py),
and fair share's turns (the prefill cap, a favoured tenant's step of its own, tenants admitted
ahead of running prefills).

The base class of Scheduler (engine/sched/scheduler.py), never used alone: it works on the
scheduler's table, KV facade and policies (the attributes declared below) and schedules each
admitted chunk through _add_prefill_chunk(). Engine thread only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from engine.core.batch import CacheHit
from engine.core.protocol import FinishReason
from engine.core.sequence import Sequence
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.admission import AdmissionPolicy
from engine.sched.fair_share import FairShare, PrefillCap
from engine.sched.request_table import RequestTable
from engine.sched.scheduler_stats import SchedulerCounters
from engine.sched.step_builder import StepBuilder


class StepAdmission(ABC):
    """Who gets into a step: admissions, rejections of what can never fit, first-admission
    records (cache hits, miss diagnosis) and fair share's turns."""

    table: RequestTable
    kv_cache_manager: KVCacheManager
    admission: AdmissionPolicy
    fair_share: FairShare
    counters: SchedulerCounters
    is_fair_share: bool
    max_num_seqs: int
    record_cache_hits: bool
    _cache_hits: list[CacheHit]
    _num_steps: int  # schedule() calls so far
    _was_solo: bool  # the last step was one tenant's alone (fair share)

    # -- fair share's turns -----------------------------------------------------------------
    def _prefilling_tenants(self) -> set[str]:
        return {seq.tenant for seq in self.table.running if not seq.is_decoding}

    def _prefill_cap(self, prefilling: set[str]) -> PrefillCap | None:
        if not self.is_fair_share:
            return None
        return self.fair_share.prefill_cap(self._live_tenants(), prefilling)

    def _solo_tenant(self, cap: PrefillCap | None) -> str | None:
        """The tenant whose step this is, alone, or None: while the prefill cap applies, the
        favoured tenant's request waiting for its first chunk gets a step without the other
        tenants' decodes and chunks (they wait this one step: never two in a row), when it
        has a seat. Its first token then costs its own prompt's step, not the others' rows."""
        if cap is None or self._was_solo:
            return None
        favoured = cap.favoured
        if all(seq.tenant == favoured for seq in self.table.running):
            return None  # nobody else to wait
        for seq in self.table.waiting:
            if seq.tenant == favoured and not seq.was_admitted:
                return favoured if self._has_seat(seq) else None
        return None

    def _admit_ahead_of_running_prefills(self, step: StepBuilder, prefilling: set[str]) -> None:
        """Tenants with no prefill running (not in `prefilling`), served no more than every
        tenant with one, are admitted before the running chunks: a tenant just lifted to the
        least counter ties with it and goes first. A tenant's own waiting requests never jump
        its own chunks."""
        if not prefilling:
            return
        least = min(self.fair_share.counter(tenant) for tenant in prefilling)
        waiting = [seq for seq in self.table.waiting if seq.tenant not in prefilling]
        self._admit_waiting(step, waiting, up_to=least)

    def _observe_tenants(self) -> None:
        if self.is_fair_share:
            self.fair_share.observe(self._live_tenants())

    def _live_tenants(self) -> list[str]:
        return [seq.tenant for seq in self.table.seqs.values()]  # oldest first

    # -- admission ----------------------------------------------------------------------------
    def _admit_waiting(
        self, step: StepBuilder, waiting: Iterable[Sequence], up_to: float | None = None
    ) -> None:
        """Admit from `waiting` in policy order until the budget, the seats or the pool runs
        out; with `up_to` (fair share), only while the next tenant's counter is at most it.
        A tenant the prefill cap leaves no tokens is passed over."""
        for seq in self.admission.order(waiting, self._num_steps):
            if step.budget == 0:
                break
            if up_to is not None and self.fair_share.counter(seq.tenant) > up_to:
                break
            if self._can_never_fit(seq):
                self._reject(seq)
                continue
            if not self._has_seat(seq):
                break
            budget = step.prefill_budget(seq.tenant)
            if budget == 0 or self.admission.is_held(seq, self.table.running):
                continue
            num_tokens = self.kv_cache_manager.admit(seq, budget)
            if num_tokens == 0:
                continue  # its second-tier blocks are being read: the next step admits it
            if num_tokens is None:
                break
            self.table.admit(seq)
            cached_block_ids = self.kv_cache_manager.take_admitted_cache_blocks(seq)
            self._record_first_admission(seq, cached_block_ids)
            self.fair_share.charge_prompt(seq.tenant, 0, seq.num_computed_tokens)
            self._add_prefill_chunk(step, seq, num_tokens)

    def _has_seat(self, seq: Sequence) -> bool:
        """Whether seq's choices fit beside the running ones under max_num_seqs."""
        return self.table.num_seats + seq.num_choices <= self.max_num_seqs

    def _record_first_admission(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """num_cached_tokens: the prompt tokens reused when seq was first admitted."""
        if seq.was_admitted:
            return
        seq.was_admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.cache_diagnosis = self.kv_cache_manager.diagnose(seq)
        num_restored = self.kv_cache_manager.take_restored_tokens(seq)
        if self.kv_cache_manager.is_prefix_caching:
            self.counters.prefix_cache_queries += seq.num_prompt_tokens
            self.counters.prefix_cache_hits += seq.num_cached_tokens
            self.counters.prefix_cache_tier_hits += num_restored
        if self.record_cache_hits and seq.num_cached_tokens > 0:
            hit = CacheHit(
                seq.seq_id,
                seq.request_id,
                seq.prompt_token_ids,
                cached_block_ids,
                seq.num_cached_tokens,
                num_restored,
            )
            self._cache_hits.append(hit)

    def _can_never_fit(self, seq: Sequence) -> bool:
        num_blocks = self.kv_cache_manager.num_blocks_for(seq.num_tokens)
        return (
            num_blocks > self.kv_cache_manager.num_total_blocks
            or seq.num_choices > self.max_num_seqs
        )

    def _reject(self, seq: Sequence) -> None:
        """A sequence the pool can never hold: an error for a prompt; a choice that
        outgrew the pool mid-generation ends with LENGTH (the pool is its context limit)."""
        request = self.table.requests[seq.request_id]
        if seq.output_token_ids:
            completions = self.table.finish_quietly(seq, FinishReason.LENGTH)
            self.table.add_pending_output(self.table.request_output(request, completions))
            return
        message = (
            f"the request needs {self.kv_cache_manager.num_blocks_for(seq.num_tokens)} KV "
            f"blocks for its {seq.num_tokens} tokens but the pool has "
            f"{self.kv_cache_manager.num_total_blocks}"
        )
        if seq.num_choices > self.max_num_seqs:
            message = f"n={seq.num_choices} exceeds max_num_seqs={self.max_num_seqs}"
        self.table.add_pending_output(self.table.fail_request(request, message))

    @abstractmethod
    def _add_prefill_chunk(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> None: ...
