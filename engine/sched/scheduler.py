"""Step-level continuous batching over the paged KV pool (torch-free).

Each step: decodes first (one token each; when blocks run out, after evicting cached ones,
the lowest-priority running sequence, the newest among equals, is preempted by recompute;
under fair share, one of the largest tenant over its share of the pool, else of the tenant
short of blocks: fair_share.preemption_victim), then prefill chunks of running sequences,
then admissions of waiting ones, all under a token budget and a sequence cap. The scheduler
reaches KV memory only through KVCacheManager.

Around it: admission.py orders the waiting queue and holds followers, step_admission.py
admits (the base class of Scheduler), request_table.py keeps the live requests, queues and
state changes, step_builder.py lays out each chunk, output_processor.py applies the runner's
output.

Write audit: a slot mapping that would write into a shared or cached block (a bug upstream)
fails only its request, with an error, quarantines the block, counts in num_write_violations,
and the step goes on without that sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from engine.core.batch import CacheHit, ModelRunnerOutput, SchedulerOutput
from engine.core.protocol import EngineRequest, EngineStats, FinishReason, RequestOutput
from engine.core.seeds import random_seed
from engine.core.sequence import Request, Sequence, SequenceStatus, make_namespace
from engine.core.spec_ngram import NgramProposer
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.admission import AdmissionPolicy
from engine.sched.fair_share import (
    FairShare,
    FairShareWeights,
    blocks_by_tenant,
    preemption_victim,
    tenants_over_share,
)
from engine.sched.lookahead import Lookahead
from engine.sched.output_processor import OutputProcessor
from engine.sched.request_table import RequestTable
from engine.sched.scheduler_stats import SchedulerCounters, engine_stats
from engine.sched.spec_scheduling import SpecScheduling
from engine.sched.step_admission import StepAdmission
from engine.sched.step_builder import StepBuilder

logger = logging.getLogger(__name__)


class Scheduler(StepAdmission):
    """Decides, each step, which tokens of which sequences the model runner computes.

    The engine calls schedule(), runs the model, then update_from_output() — after EVERY
    schedule(), even an empty one: requests the scheduler finishes on its own (one that can
    never fit the pool) are reported there. add_request/abort_request/fail_seqs are called
    between steps, from the same thread.

    weights_version goes into every request's cache namespace (make_namespace).
    scheduling_policy: "fcfs", "longest-prefix-first" or "fair-share" (admission.py);
    fair_share_weights price what each tenant's counter is charged, under every policy. Under
    fair share, while two or more tenants are active (a live request, or one that ended less
    than fair_share_active_seconds ago by `clock`), the prefill tokens of tenants other than
    the least served share a cap of fair_share_prefill_tokens (0: none; fair_share.PrefillCap).
    With record_cache_hits, each first admission that reuses cached tokens is kept as a
    CacheHit for take_cache_hits() (the engine drains them every step for the auditor).
    With a `proposer`, decodes may carry a speculative draft in steps with at most
    speculative_max_decodes decodes (0: any number; spec_scheduling.py).
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
        self.lookahead = Lookahead(self.table, kv_cache_manager, max_model_len, max_num_seqs)
        self.output_processor = OutputProcessor(
            self.table,
            kv_cache_manager,
            self.spec,
            self.counters,
            self.fair_share,
            self.eos_token_ids,
            max_model_len,
        )

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
        step.output.block_spills = self.kv_cache_manager.take_block_spills()
        step.output.block_loads = self.kv_cache_manager.take_block_loads()
        step.output.finished_request_ids = self.take_finished_request_ids()
        if num_spare_tokens is None:
            num_spare_tokens = step.num_spare_tokens()
        step.output.num_spare_tokens = num_spare_tokens
        return step.output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens, fork n-choice requests, apply stop checks, free finished
        (engine/sched/output_processor.py).

        Returns one delta per request that changed, plus requests finished outside a step.
        Sequences finished since schedule() (aborted, failed) are skipped.
        """
        in_flight = self.lookahead.rewind()  # the next step's decodes, scheduled already
        self.kv_cache_manager.store_spilled(scheduler_output.block_spills, runner_output.spilled_kv)
        outputs = self.output_processor.process(scheduler_output, runner_output)
        self.lookahead.advance(in_flight)
        self._observe_tenants()  # the requests that ended in this step end now
        return outputs

    def schedule_lookahead(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `previous`, scheduled before update_from_output(previous) (async
        scheduling, engine/sched/lookahead.py): `previous`'s decodes once more, each on the
        token `previous` samples for it (previous_token_rows). None where the outputs do
        not allow it; then update_from_output(previous) comes first, then schedule()."""
        candidates = self.lookahead.candidates(previous, self.spec.drafts_among)
        if not candidates:
            return None
        step = StepBuilder(self.kv_cache_manager, self.max_num_batched_tokens)
        rows = self.lookahead.build(candidates, step)
        if not rows and not step.violations:
            return None  # nothing changed: update_from_output(previous), then schedule()
        self._num_steps += 1
        step.output.num_decodes = len(step.output.seqs)
        step.output.previous_token_rows = rows
        self.counters.num_lookahead_steps += 1
        return self._finish_schedule(step, num_spare_tokens=0)

    def drop_lookahead(self) -> None:
        """The lookahead step will not run (a fault): its sequences as schedule() left them;
        the engine fails them, since the copies it scheduled were not made."""
        self.lookahead.rewind()

    def check_integrity(self) -> None:
        """Queues, statuses and block tables agree; refcounts == live references; the
        running choices fit max_num_seqs."""
        self.table.check_integrity()
        assert self.table.num_seats <= self.max_num_seqs

    # -- schedule phases (admissions: StepAdmission) -----------------------------------------
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

    def _add_prefill_chunk(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> None:
        """A prefill chunk, charged to seq's tenant as computed prompt tokens (outputs
        recomputed after a preemption count as prompt: they are computed again)."""
        step.add_chunk(seq, num_tokens)
        self.fair_share.charge_prompt(seq.tenant, num_tokens)

    def _reserve_slots(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> bool:
        """allocate_slots, preempting an unscheduled running seq until it fits (see
        _preemption_victim); False when seq itself was the one preempted."""
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
