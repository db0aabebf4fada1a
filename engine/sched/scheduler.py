"""Step-level continuous batching over the paged KV pool (torch-free).

Each step: decodes first (one token per decoding sequence, preempting the lowest-priority
running sequence, the newest among equals, by recompute when blocks run out, after cached
blocks were evicted; under fair share, one of the largest tenant over its share of the pool,
else of the tenant short of blocks: fair_share.preemption_victim), then prefill
chunks of running sequences, then admission of waiting sequences, all under a token budget
and a sequence cap. The scheduler reaches KV memory only through KVCacheManager.

Admission order and the in-batch hold of followers live in admission.py; the live requests
and sequences, the two queues and a sequence's state changes in request_table.py; the layout
of each scheduled chunk in the step's SchedulerOutput in step_builder.py.

Write audit: a slot mapping that would write into a shared or cached block (a bug upstream)
fails only the request it belongs to, with an error, quarantines the block, is counted in
num_write_violations, and the step goes on without that sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from engine.core.batch import (
    CacheHit,
    ModelRunnerOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.core.protocol import (
    CompletionOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from engine.core.seeds import random_seed
from engine.core.sequence import Request, Sequence, SequenceStatus, make_namespace
from engine.core.spec_ngram import NgramProposer
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.admission import AdmissionPolicy
from engine.sched.fair_share import (
    FairShare,
    FairShareWeights,
    PrefillCap,
    blocks_by_tenant,
    preemption_victim,
    tenants_over_share,
)
from engine.sched.request_table import RequestTable
from engine.sched.scheduler_stats import SchedulerCounters, engine_stats
from engine.sched.spec_scheduling import SpecScheduling
from engine.sched.step_builder import StepBuilder

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which tokens of which sequences the model runner computes.

    The engine calls schedule(), runs the model, then update_from_output() — after EVERY
    schedule(), even an empty one: requests the scheduler finishes on its own (one that can
    never fit the pool) are reported there. add_request/abort_request/fail_seqs are called
    between steps, from the same thread.

    weights_version goes into every request's prefix-cache namespace
    (make_namespace(weights_version, None, request.cache_salt)); scheduling_policy is
    "fcfs", "longest-prefix-first" or "fair-share" (see admission.py; fair_share_weights
    price the service each tenant's counter is charged, under every policy). Under fair
    share, while two or more tenants are active (a live request, or the last one ended less
    than fair_share_active_seconds ago by `clock`), the prefill tokens of a step other than
    the least-served active tenant's share a cap of fair_share_prefill_tokens (0: no cap;
    engine/sched/fair_share.py PrefillCap). With record_cache_hits, every first admission
    that reuses cached tokens is kept as a CacheHit for take_cache_hits() (the engine drains
    them every step for the auditor).

    With a `proposer`, decodes may carry a speculative draft (only in steps where at most
    speculative_max_decodes sequences decode; 0: any number): what is drafted and what a
    verified step keeps is decided in engine/sched/spec_scheduling.py.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        *,
        weights_version: str = "",
        scheduling_policy: str = "fcfs",
        record_cache_hits: bool = False,
        proposer: NgramProposer | None = None,
        speculative_max_decodes: int = 0,
        fair_share_weights: FairShareWeights | None = None,
        fair_share_prefill_tokens: int = 0,
        fair_share_active_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_model_len >= 2
        self.kv_cache_manager = kv_cache_manager
        self.weights_version = weights_version  # part of every request's cache namespace
        self.fair_share = FairShare(
            fair_share_weights, fair_share_prefill_tokens, fair_share_active_seconds, clock
        )
        self.admission = AdmissionPolicy(kv_cache_manager, scheduling_policy, self.fair_share)
        self.is_fair_share = scheduling_policy == "fair-share"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.counters = SchedulerCounters()
        self.table = RequestTable(kv_cache_manager)
        self._num_steps = 0  # schedule() calls so far
        self.record_cache_hits = record_cache_hits
        self._cache_hits: list[CacheHit] = []
        self.spec = SpecScheduling(
            proposer, kv_cache_manager, max_model_len, max_decodes=speculative_max_decodes
        )
        self._was_solo = False  # the last step was one tenant's alone (fair share)

    # -- state --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def num_waiting(self) -> int:
        return len(self.table.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.table.has_unfinished_requests()

    def get_seq(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence (read only), e.g. for the auditor; None once finished."""
        return self.table.seqs.get(seq_id)

    def live_sequences(self) -> list[Sequence]:
        """Every unfinished sequence (read only), oldest first."""
        return list(self.table.seqs.values())

    def num_leaked_blocks(self) -> int:
        return self.kv_cache_manager.num_leaked_blocks(self.live_sequences())

    def take_finished_request_ids(self) -> list[str]:
        """Requests finished since the last call; schedule() puts them in its output, so the
        runtime drops what it keeps per request (call it directly before reusing an id)."""
        return self.table.take_finished_request_ids()

    def take_cache_hits(self) -> list[CacheHit]:
        """Cache hits recorded since the last call (only with record_cache_hits)."""
        hits, self._cache_hits = self._cache_hits, []
        return hits

    def stats(self, **fields: Any) -> EngineStats:
        """Queue sizes, block usage, the leak count and counters: O(1) or O(live sequences),
        never a walk of the pool or the tree. Engine thread only (reads live state); fields
        the scheduler does not own (bytes_per_block, audits, the step) are `fields`, or
        default. One construction: the engine builds a snapshot every step."""
        return engine_stats(
            self.counters,
            self.kv_cache_manager,
            self.num_running,
            self.num_waiting,
            self.num_leaked_blocks(),
            fair_share_counter_spread=self.fair_share.spread(),
            **fields,
        )

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a validated request; its n choices run as one sequence until the fork."""
        params = request.sampling_params
        num_prompt_tokens = len(request.prompt_token_ids)
        assert request.request_id not in self.table.requests, f"duplicate {request.request_id}"
        assert 1 <= num_prompt_tokens < self.max_model_len, (
            f"request {request.request_id}: {num_prompt_tokens} prompt tokens, "
            f"max_model_len {self.max_model_len}"
        )
        seed = params.seed if params.seed is not None else random_seed()
        seq = Sequence(
            seq_id=self.table.new_seq_id(),
            request_id=request.request_id,
            choice_index=0,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params,
            seed=seed,
            num_choices=params.n,
            cache_namespace=make_namespace(self.weights_version, None, request.cache_salt),
            arrival_step=self._num_steps,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            tenant=request.tenant or "",
            priority=request.priority,
            num_volatile_prefix_tokens=request.num_volatile_prefix_tokens,
        )
        live_tenants = {live.tenant for live in self.table.seqs.values()}
        if seq.tenant not in live_tenants:
            self.fair_share.activate(seq.tenant, live_tenants)
        self.table.add(Request(request, seed, [seq]))
        self.counters.num_prompt_tokens += num_prompt_tokens

    def abort_request(
        self,
        request_id: str,
        choice_index: int | None = None,
        reason: FinishReason = FinishReason.ABORT,
    ) -> RequestOutput | None:
        """Finish a whole request, or one choice of it, and free its blocks at once.

        Returns the final delta (no new tokens, `reason` as finish_reason), or None when the
        request or choice is unknown or already finished. A single choice can be aborted only
        once it has forked (it has output tokens); before that ChoiceNotForked is raised.
        """
        output = self.table.abort(request_id, choice_index, reason)
        self._observe_tenants()
        return output

    def fail_seqs(self, seq_ids: Iterable[int], message: str) -> list[RequestOutput]:
        """Engine fault: finish every request owning one of seq_ids with ERROR + message.

        Other requests are untouched. Unknown or finished ids are ignored.
        """
        outputs = self.table.fail_seqs(seq_ids, message)
        self._observe_tenants()
        return outputs

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: decodes, then running prefills, then admissions (fair
        share: admissions of tenants served no more than any running prefill's come first,
        and a prefill cap while several tenants are active; the favoured tenant's new request
        may get a step of its own, see _solo_tenant)."""
        self._num_steps += 1
        # Tenants with a prefill running, once per step (fair share only); decodes do not
        # change it, and a preemption skips the pass that reads it again.
        prefilling = self._prefilling_tenants() if self.is_fair_share else set()
        cap = self._prefill_cap(prefilling)
        solo = self._solo_tenant(cap)
        self._was_solo = solo is not None
        step = StepBuilder(self.kv_cache_manager, self.max_num_batched_tokens, cap)
        self._schedule_decodes(step, solo)
        if solo is not None and not step.num_preempted:
            num_decodes = len(step.output.seqs)
            self._admit_waiting(step, [seq for seq in self.table.waiting if seq.tenant == solo])
            if len(step.output.seqs) > num_decodes:  # its first chunk is in: nothing else
                return self._finish_schedule(step, num_spare_tokens=0)
        if self.is_fair_share and not step.num_preempted:
            self._admit_ahead_of_running_prefills(step, prefilling)
        self._schedule_running_prefills(step)
        if not step.num_preempted:  # blocks just taken from a victim: do not re-admit it now
            self._admit_waiting(step, self.table.waiting)
        return self._finish_schedule(step)

    def _finish_schedule(
        self, step: StepBuilder, num_spare_tokens: int | None = None
    ) -> SchedulerOutput:
        """The step's output, once everything is scheduled; num_spare_tokens (default: what
        the budget and the cap leave) bounds the audit work the step may carry."""
        self._fail_write_violations(step)  # after every allocation: freed blocks stay unused
        self.counters.num_prefill_tokens += step.num_prefill_tokens
        step.output.block_copies = self.kv_cache_manager.take_block_copies()
        step.output.finished_request_ids = self.take_finished_request_ids()
        if num_spare_tokens is None:
            num_spare_tokens = step.num_spare_tokens()
        step.output.num_spare_tokens = num_spare_tokens
        return step.output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens, fork n-choice requests, apply stop checks, free finished.

        Returns one delta per request that changed, plus requests finished outside a step.
        Sequences finished since schedule() (aborted, failed) are skipped.
        """
        completions: dict[str, list[CompletionOutput]] = {}
        for scheduled in scheduler_output.seqs:
            seq = self.table.seqs.get(scheduled.seq_id)
            if seq is None:
                continue
            if scheduled.draft_token_ids:
                completion = self._verify(seq, scheduled, runner_output)
                completions.setdefault(seq.request_id, []).append(completion)
                continue
            self.kv_cache_manager.insert_prefix(seq)  # its chunk is computed: cache full blocks
            if scheduled.prompt_logprobs is not None:
                seq.add_prompt_logprobs(runner_output.prompt_logprobs[seq.seq_id])
            if scheduled.sample is None:
                if seq.is_prompt_only and seq.num_uncomputed_tokens == 0:
                    completions.setdefault(seq.request_id, []).extend(
                        self.table.finish_quietly(seq, FinishReason.LENGTH)
                    )
                continue
            sampled = self._sampled_tokens(runner_output, seq)
            for choice_seq, token in zip(self.table.fork(seq), sampled, strict=True):
                completion = self._append_token(choice_seq, token)
                completions.setdefault(seq.request_id, []).append(completion)
        outputs = self.table.take_pending_outputs()
        for request_id, request_completions in completions.items():
            request = self.table.requests[request_id]
            outputs.append(self.table.request_output(request, request_completions))
        self._observe_tenants()  # the requests that ended in this step end now
        return outputs

    def check_integrity(self) -> None:
        """Queues, statuses and block tables agree; refcounts == live references; the
        running choices fit max_num_seqs."""
        self.table.check_integrity()
        assert self.table.num_seats <= self.max_num_seqs

    # -- schedule phases -------------------------------------------------------------------
    def _schedule_decodes(self, step: StepBuilder, only_tenant: str | None = None) -> None:
        """One token per decoding sequence (only only_tenant's, when given); those with a
        draft come after the plain decodes (their 1 + k tokens are verified like a prefill
        chunk)."""
        drafted: list[tuple[Sequence, list[int]]] = []
        decoding = [
            s for s in self.table.running if s.is_decoding and only_tenant in (None, s.tenant)
        ]
        may_draft = self.spec.drafts_among(len(decoding))
        for seq in self._order_decodes(decoding, may_draft):
            if step.budget == 0:
                break
            if not seq.is_decoding:
                continue  # preempted for an older sequence's slots in this step
            draft = self.spec.draft(seq, step.budget - 1) if may_draft else []
            if draft:
                drafted.append((seq, draft))
            elif self._reserve_slots(step, seq, 1):
                step.add_chunk(seq, 1)
        step.output.num_decodes = len(step.output.seqs)
        for seq, draft in drafted:
            if seq.status is not SequenceStatus.RUNNING or step.budget == 0:
                continue  # preempted for an older sequence's slots, or no budget left
            draft = self.spec.allocate(seq, draft, step.budget)
            if draft or self._reserve_slots(step, seq, 1):
                step.add_chunk(seq, 1 + len(draft), draft)

    def _order_decodes(self, decoding: list[Sequence], may_draft: bool) -> list[Sequence]:
        """Fair share, when a decode may have to preempt: the decodes of tenants over their
        share of the KV pool go last, so a tenant within its share takes its slot while
        theirs can still be preempted. A plain decode takes one block at most."""
        if not self.is_fair_share:
            return decoding
        # Room for every decode (a drafted one spans two blocks at most): nobody preempts.
        if self.kv_cache_manager.num_free_blocks >= len(decoding) * (2 if may_draft else 1):
            return decoding
        if len({seq.tenant for seq in decoding}) < 2:
            return decoding
        num_blocks = blocks_by_tenant(self.table.running)
        over = tenants_over_share(num_blocks, self.kv_cache_manager.num_total_blocks)
        return sorted(decoding, key=lambda seq: seq.tenant in over)  # stable

    def _schedule_running_prefills(self, step: StepBuilder) -> None:
        running = self.table.running
        if self.is_fair_share:
            running = self.fair_share.order_running(running)
        for seq in list(running):
            if step.budget == 0:
                break
            # Skip the preempted, the scheduled, and decodes the budget left out.
            skip = seq.status is not SequenceStatus.RUNNING or seq.seq_id in step.scheduled_ids
            if skip or seq.is_decoding:
                continue
            num_tokens = min(seq.num_uncomputed_tokens, step.prefill_budget(seq.tenant))
            if num_tokens > 0 and self._reserve_slots(step, seq, num_tokens):
                self._add_prefill_chunk(step, seq, num_tokens)

    # -- fair share ------------------------------------------------------------------------
    def _prefilling_tenants(self) -> set[str]:
        return {seq.tenant for seq in self.table.running if not seq.is_decoding}

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

    def _has_seat(self, seq: Sequence) -> bool:
        """Whether seq's choices fit beside the running ones under max_num_seqs."""
        return self.table.num_seats + seq.num_choices <= self.max_num_seqs

    def _prefill_cap(self, prefilling: set[str]) -> PrefillCap | None:
        if not self.is_fair_share:
            return None
        return self.fair_share.prefill_cap(self._live_tenants(), prefilling)

    def _observe_tenants(self) -> None:
        if self.is_fair_share:
            self.fair_share.observe(self._live_tenants())

    def _live_tenants(self) -> list[str]:
        return [seq.tenant for seq in self.table.seqs.values()]  # oldest first

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
            if num_tokens is None:
                break
            self.table.admit(seq)
            cached_block_ids = self.kv_cache_manager.take_admitted_cache_blocks(seq)
            self._record_first_admission(seq, cached_block_ids)
            self.fair_share.charge_prompt(seq.tenant, 0, seq.num_computed_tokens)
            self._add_prefill_chunk(step, seq, num_tokens)

    def _add_prefill_chunk(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> None:
        """A prefill chunk, charged to seq's tenant as computed prompt tokens (outputs
        recomputed after a preemption count as prompt: they are computed again)."""
        step.add_chunk(seq, num_tokens)
        self.fair_share.charge_prompt(seq.tenant, num_tokens)

    def _record_first_admission(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """num_cached_tokens: the prompt tokens reused when seq was first admitted."""
        if seq.was_admitted:
            return
        seq.was_admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.cache_diagnosis = self.kv_cache_manager.diagnose(seq)
        if self.kv_cache_manager.is_prefix_caching:
            self.counters.prefix_cache_queries += seq.num_prompt_tokens
            self.counters.prefix_cache_hits += seq.num_cached_tokens
        if self.record_cache_hits and seq.num_cached_tokens > 0:
            hit = CacheHit(
                seq.seq_id,
                seq.request_id,
                seq.prompt_token_ids,
                cached_block_ids,
                seq.num_cached_tokens,
            )
            self._cache_hits.append(hit)

    def _reserve_slots(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> bool:
        """allocate_slots, preempting an unscheduled running seq until it fits (see
        _preemption_victim).

        False when seq itself was the one preempted.
        """
        while not self.kv_cache_manager.allocate_slots(seq, num_tokens):
            victim = self._preemption_victim(step, seq)
            self.table.preempt(victim)
            self.counters.num_preemptions += 1
            step.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preemption_victim(self, step: StepBuilder, seq: Sequence) -> Sequence:
        """Who gives seq its blocks: the highest priority value, the newest among equals;
        under fair share, of one tenant only (fair_share.preemption_victim)."""
        running, scheduled_ids = self.table.running, step.scheduled_ids
        if not self.is_fair_share:
            return preemption_victim(running, scheduled_ids)
        num_total_blocks = self.kv_cache_manager.num_total_blocks
        return preemption_victim(running, scheduled_ids, seq, num_total_blocks)

    def _fail_write_violations(self, step: StepBuilder) -> None:
        """Fail the request of each sequence whose slot mapping broke read-only sharing and
        quarantine the block it would have written; everything else goes on."""
        for seq, violation in step.violations:
            request = self.table.requests.get(seq.request_id)
            if request is None:  # a sibling choice already failed it
                continue
            block_id = violation.block_id
            quarantined = self.kv_cache_manager.quarantine([] if block_id is None else [block_id])
            self.counters.num_write_violations += 1
            logger.warning(
                "KV write violation in request %s: %s; failing it, quarantined blocks %s",
                seq.request_id,
                violation,
                quarantined,
            )
            message = f"internal KV cache error (write into a shared block): {violation}"
            self.table.add_pending_output(self.table.fail_request(request, message))

    # -- admission limits ------------------------------------------------------------------
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

    # -- update phases ---------------------------------------------------------------------
    @staticmethod
    def _sampled_tokens(runner_output: ModelRunnerOutput, seq: Sequence) -> list[SampledToken]:
        sampled = runner_output.sampled.get(seq.seq_id)
        if sampled is None or len(sampled) != seq.num_choices:
            raise RuntimeError(
                f"runner returned {sampled!r} for seq {seq.seq_id}, "
                f"expected {seq.num_choices} sampled token(s)"
            )
        return sampled

    def _verify(
        self, seq: Sequence, scheduled: ScheduledSeq, runner_output: ModelRunnerOutput
    ) -> CompletionOutput:
        completion, num_kept = self.spec.verify(seq, scheduled, runner_output, self._append_token)
        self.counters.num_spec_draft_tokens += len(scheduled.draft_token_ids)
        self.counters.num_spec_accepted_tokens += num_kept
        return completion

    def _append_token(self, seq: Sequence, token: SampledToken) -> CompletionOutput:
        seq.output_token_ids.append(token.token_id)
        self.counters.num_generation_tokens += 1
        self.fair_share.charge_output(seq.tenant)
        reason, stop_token_id = seq.check_stop(self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.kv_cache_manager.insert_prefix(seq)  # prompt + outputs, for the next turn
            self.table.retire(seq, reason)
        return seq.completion(token, reason, stop_token_id)
