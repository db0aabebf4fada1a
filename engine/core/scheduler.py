"""Step-level continuous batching over the paged KV pool (torch-free).

Each step: decodes first (one token per decoding sequence, preempting the newest running
sequence by recompute when blocks run out, after cached blocks were evicted), then prefill
chunks of running sequences, then admission of waiting sequences, all under a token budget
and a sequence cap. The scheduler reaches KV memory only through KVCacheManager.

Admission order and the in-batch hold of followers live in admission.py.

Write audit: a slot mapping that would write into a shared or cached block (a bug upstream)
fails only the request it belongs to, with an error, quarantines the block, is counted in
num_write_violations, and the step goes on without that sequence.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.admission import AdmissionPolicy
from engine.core.batch import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.core.errors import ChoiceNotForked
from engine.core.protocol import (
    CompletionOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from engine.core.scheduler_stats import SchedulerCounters, engine_stats
from engine.core.seeds import random_seed
from engine.core.sequence import Request, Sequence, SequenceStatus, make_namespace
from engine.core.spec_ngram import NgramProposer
from engine.core.spec_scheduling import SpecScheduling
from engine.kv.kv_cache_manager import KVCacheManager, WriteViolation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheHit:
    """A sequence admitted for the first time with a cached prefix (for the cache auditor).

    cached_block_ids: the tree blocks it reused, in order (full blocks, then the source of
    its partial copy); they cover its first num_cached_tokens prompt tokens.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]  # read only
    cached_block_ids: list[int]
    num_cached_tokens: int


@dataclass
class _Step:
    """The SchedulerOutput being built and what is left of the step's token budget."""

    budget: int
    output: SchedulerOutput = field(default_factory=SchedulerOutput)
    scheduled_ids: set[int] = field(default_factory=set)
    num_preempted: int = 0
    violations: list[tuple[Sequence, WriteViolation]] = field(default_factory=list)


class Scheduler:
    """Decides, each step, which tokens of which sequences the model runner computes.

    The engine calls schedule(), runs the model, then update_from_output() — after EVERY
    schedule(), even an empty one: requests the scheduler finishes on its own (one that can
    never fit the pool) are reported there. add_request/abort_request/fail_seqs are called
    between steps, from the same thread.

    weights_version goes into every request's prefix-cache namespace
    (make_namespace(weights_version, None, request.cache_salt)); scheduling_policy is
    "fcfs" or "longest-prefix-first" (see admission.py). With record_cache_hits,
    every first admission that reuses cached tokens is kept as a CacheHit for
    take_cache_hits() (the engine drains them every step for the auditor).

    With a `proposer`, decodes may carry a speculative draft: what is drafted and what a
    verified step keeps is decided in engine/core/spec_scheduling.py.
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
    ) -> None:
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_model_len >= 2
        self.kv_cache_manager = kv_cache_manager
        self.weights_version = weights_version  # part of every request's cache namespace
        self.admission = AdmissionPolicy(kv_cache_manager, scheduling_policy)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.counters = SchedulerCounters()
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order: the last is the newest
        self._pending_outputs: list[RequestOutput] = []  # finished outside a model step
        self._finished_request_ids: list[str] = []  # since the last schedule(), for the runtime
        self._next_seq_id = 0
        self._num_steps = 0  # schedule() calls so far
        self.record_cache_hits = record_cache_hits
        self._cache_hits: list[CacheHit] = []
        self.spec = SpecScheduling(proposer, kv_cache_manager, max_model_len)

    # -- state --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    def get_seq(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence (read only), e.g. for the auditor; None once finished."""
        return self._seqs.get(seq_id)

    def live_sequences(self) -> list[Sequence]:
        """Every unfinished sequence (read only), oldest first."""
        return list(self._seqs.values())

    def num_leaked_blocks(self) -> int:
        return self.kv_cache_manager.num_leaked_blocks(list(self._seqs.values()))

    def take_finished_request_ids(self) -> list[str]:
        """Requests finished since the last call; schedule() puts them in its output, so the
        runtime drops what it keeps per request (call it directly before reusing an id)."""
        ids, self._finished_request_ids = self._finished_request_ids, []
        return ids

    def take_cache_hits(self) -> list[CacheHit]:
        """Cache hits recorded since the last call (only with record_cache_hits)."""
        hits, self._cache_hits = self._cache_hits, []
        return hits

    def stats(self) -> EngineStats:
        """Queue sizes, block usage, the leak count and counters: O(1) or O(live sequences),
        never a walk of the pool or the tree. Engine thread only (reads live state); fields
        the scheduler does not own (bytes_per_block, audits, the step) stay default."""
        return engine_stats(
            self.counters,
            self.kv_cache_manager,
            self.num_running,
            self.num_waiting,
            self.num_leaked_blocks(),
        )

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a validated request; its n choices run as one sequence until the fork."""
        params = request.sampling_params
        num_prompt_tokens = len(request.prompt_token_ids)
        assert request.request_id not in self._requests, f"duplicate {request.request_id}"
        assert 1 <= num_prompt_tokens < self.max_model_len, (
            f"request {request.request_id}: {num_prompt_tokens} prompt tokens, "
            f"max_model_len {self.max_model_len}"
        )
        seed = params.seed if params.seed is not None else random_seed()
        seq = Sequence(
            seq_id=self._new_seq_id(),
            request_id=request.request_id,
            choice_index=0,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params,
            seed=seed,
            num_choices=params.n,
            cache_namespace=make_namespace(self.weights_version, None, request.cache_salt),
            arrival_step=self._num_steps,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        self._requests[request.request_id] = Request(request, seed, [seq])
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
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
        request = self._requests.get(request_id)
        if request is None:
            return None
        seqs = request.unfinished_sequences()
        if choice_index is not None:
            seq = request.sequence_for_choice(choice_index)
            if seq is None or seq.is_finished:
                return None
            if seq.num_choices > 1:
                raise ChoiceNotForked(
                    f"choice {choice_index} of request {request_id} has not forked yet"
                )
            seqs = [seq]
        completions = [c for seq in seqs for c in self._finish_quietly(seq, reason)]
        return self._request_output(request, completions)

    def fail_seqs(self, seq_ids: Iterable[int], message: str) -> list[RequestOutput]:
        """Engine fault: finish every request owning one of seq_ids with ERROR + message.

        Other requests are untouched. Unknown or finished ids are ignored.
        """
        request_ids = dict.fromkeys(
            self._seqs[seq_id].request_id for seq_id in seq_ids if seq_id in self._seqs
        )
        return [self._fail_request(self._requests[r], message) for r in request_ids]

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: decodes, then running prefills, then admissions."""
        self._num_steps += 1
        step = _Step(budget=self.max_num_batched_tokens)
        self._schedule_decodes(step)
        self._schedule_running_prefills(step)
        if not step.num_preempted:  # blocks just taken from a victim: do not re-admit it now
            self._admit_waiting(step)
        self._fail_write_violations(step)  # after every allocation: freed blocks stay unused
        step.output.block_copies = self.kv_cache_manager.take_block_copies()
        step.output.finished_request_ids = self.take_finished_request_ids()
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
            seq = self._seqs.get(scheduled.seq_id)
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
                        self._finish_quietly(seq, FinishReason.LENGTH)
                    )
                continue
            sampled = self._sampled_tokens(runner_output, seq)
            for choice_seq, token in zip(self._fork(seq), sampled, strict=True):
                completion = self._append_token(choice_seq, token)
                completions.setdefault(seq.request_id, []).append(completion)
        outputs, self._pending_outputs = self._pending_outputs, []
        for request_id, request_completions in completions.items():
            outputs.append(self._request_output(self._requests[request_id], request_completions))
        return outputs

    def check_integrity(self) -> None:
        """Queues, statuses and block tables agree; refcounts == live references."""
        live = list(self._seqs.values())
        self.kv_cache_manager.check_integrity(live)
        assert len(self._waiting) + len(self._running) == len(live), "a live seq is lost"
        for seq in self._waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq.seq_id
        for seq in self._running:
            assert seq.status is SequenceStatus.RUNNING, seq.seq_id
            num_blocks = self.kv_cache_manager.num_blocks_for(seq.num_computed_tokens)
            assert len(seq.block_ids) == num_blocks, f"seq {seq.seq_id}: {seq.block_ids}"
        assert self._num_seats() <= self.max_num_seqs
        for request in self._requests.values():
            assert not request.is_finished, f"finished request {request.request_id} kept"

    # -- schedule phases -------------------------------------------------------------------
    def _schedule_decodes(self, step: _Step) -> None:
        """One token per decoding sequence; those with a draft come after the plain decodes
        (their 1 + k tokens are verified like a prefill chunk)."""
        drafted: list[tuple[Sequence, list[int]]] = []
        for seq in list(self._running):
            if step.budget == 0:
                break
            if not seq.is_decoding:
                continue
            draft = self.spec.draft(seq, step.budget - 1)
            if draft:
                drafted.append((seq, draft))
            elif self._reserve_slots(step, seq, 1):
                self._add_chunk(step, seq, 1)
        step.output.num_decodes = len(step.output.seqs)
        for seq, draft in drafted:
            if seq.status is not SequenceStatus.RUNNING or step.budget == 0:
                continue  # preempted for an older sequence's slots, or no budget left
            draft = self.spec.fit(seq, draft, step.budget)
            if self._reserve_slots(step, seq, 1 + len(draft)):
                self._add_chunk(step, seq, 1 + len(draft), draft)

    def _schedule_running_prefills(self, step: _Step) -> None:
        for seq in list(self._running):
            if step.budget == 0:
                break
            # Skip the preempted, the scheduled, and decodes the budget left out.
            skip = seq.status is not SequenceStatus.RUNNING or seq.seq_id in step.scheduled_ids
            if skip or seq.is_decoding:
                continue
            num_tokens = min(seq.num_uncomputed_tokens, step.budget)
            if self._reserve_slots(step, seq, num_tokens):
                self._add_chunk(step, seq, num_tokens)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit in policy order until the budget, the seats or the pool runs out."""
        for seq in self.admission.order(self._waiting, self._num_steps):
            if step.budget == 0:
                break
            if self._can_never_fit(seq):
                self._reject(seq)
                continue
            if self._num_seats() + seq.num_choices > self.max_num_seqs:
                break
            if self.admission.is_held(seq, self._running):
                continue
            num_tokens = self.kv_cache_manager.admit(seq, step.budget)
            if num_tokens is None:
                break
            self._waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            cached_block_ids = self.kv_cache_manager.take_admitted_cache_blocks(seq)
            self._record_first_admission(seq, cached_block_ids)
            self._add_chunk(step, seq, num_tokens)

    def _record_first_admission(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """num_cached_tokens: the prompt tokens reused when seq was first admitted."""
        if seq.was_admitted:
            return
        seq.was_admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
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

    def _reserve_slots(self, step: _Step, seq: Sequence, num_tokens: int) -> bool:
        """allocate_slots, preempting the newest unscheduled running seq until it fits.

        False when seq itself was the one preempted.
        """
        while not self.kv_cache_manager.allocate_slots(seq, num_tokens):
            victim = next(s for s in reversed(self._running) if s.seq_id not in step.scheduled_ids)
            self._preempt(victim)
            step.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks, put it at the front of the waiting queue."""
        self.kv_cache_manager.free(seq)
        self._running.remove(seq)
        seq.reset_for_recompute()
        self._waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def _add_chunk(
        self, step: _Step, seq: Sequence, num_tokens: int, draft: list[int] | None = None
    ) -> None:
        """Schedule seq's next num_tokens positions: its own tokens, then `draft` (whose
        positions count as computed until update_from_output keeps or gives them back)."""
        assert num_tokens >= 1
        draft = draft or []
        try:
            slots = self.kv_cache_manager.slot_mapping(seq, num_tokens)
        except WriteViolation as violation:  # not scheduled; its request fails after admission
            step.violations.append((seq, violation))
            step.scheduled_ids.add(seq.seq_id)
            return
        start = seq.num_computed_tokens
        is_prefill = not seq.is_decoding
        end = start + num_tokens
        own_end = end - len(draft)
        is_last = own_end == seq.num_tokens and not seq.is_prompt_only
        step.output.seqs.append(
            ScheduledSeq(
                seq.seq_id,
                seq.token_slice(start, own_end) + draft,
                start,
                list(seq.block_ids),
                seq.sample_spec() if is_last else None,
                seq.prompt_logprobs_spec(start, end),
                draft,
            )
        )
        step.output.slot_mapping.extend(slots)
        seq.num_computed_tokens = end
        step.budget -= num_tokens
        step.scheduled_ids.add(seq.seq_id)
        if is_prefill:
            self.counters.num_prefill_tokens += num_tokens

    def _fail_write_violations(self, step: _Step) -> None:
        """Fail the request of each sequence whose slot mapping broke read-only sharing and
        quarantine the block it would have written; everything else goes on."""
        for seq, violation in step.violations:
            request = self._requests.get(seq.request_id)
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
            self._pending_outputs.append(self._fail_request(request, message))

    # -- admission limits ------------------------------------------------------------------
    def _num_seats(self) -> int:
        """Running choices: an unforked n-choice sequence takes n seats (it forks into n)."""
        return sum(seq.num_choices for seq in self._running)

    def _can_never_fit(self, seq: Sequence) -> bool:
        num_blocks = self.kv_cache_manager.num_blocks_for(seq.num_tokens)
        return (
            num_blocks > self.kv_cache_manager.num_total_blocks
            or seq.num_choices > self.max_num_seqs
        )

    def _reject(self, seq: Sequence) -> None:
        """A sequence the pool can never hold: an error for a prompt; a choice that
        outgrew the pool mid-generation ends with LENGTH (the pool is its context limit)."""
        request = self._requests[seq.request_id]
        if seq.output_token_ids:
            completions = self._finish_quietly(seq, FinishReason.LENGTH)
            self._pending_outputs.append(self._request_output(request, completions))
            return
        message = (
            f"the request needs {self.kv_cache_manager.num_blocks_for(seq.num_tokens)} KV "
            f"blocks for its {seq.num_tokens} tokens but the pool has "
            f"{self.kv_cache_manager.num_total_blocks}"
        )
        if seq.num_choices > self.max_num_seqs:
            message = f"n={seq.num_choices} exceeds max_num_seqs={self.max_num_seqs}"
        self._pending_outputs.append(self._fail_request(request, message))

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

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """[seq] for one choice; at an n-choice parent's first sample, its n choices."""
        if seq.num_choices == 1:
            return [seq]
        children = [seq.make_child(self._new_seq_id(), i) for i in range(1, seq.num_choices)]
        seq.num_choices = 1
        position = self._running.index(seq) + 1
        self._running[position:position] = children  # as old as their parent
        for child in children:
            self.kv_cache_manager.fork(seq, child)
            self._seqs[child.seq_id] = child
        self._requests[seq.request_id].add_children(children)
        return [seq, *children]

    def _append_token(self, seq: Sequence, token: SampledToken) -> CompletionOutput:
        seq.output_token_ids.append(token.token_id)
        self.counters.num_generation_tokens += 1
        reason, stop_token_id = seq.check_stop(self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.kv_cache_manager.insert_prefix(seq)  # prompt + outputs, for the next turn
            self._retire(seq, reason)
        return seq.completion(token, reason, stop_token_id)

    # -- finishing -------------------------------------------------------------------------
    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """Free seq's blocks at once and drop it from the queues."""
        self.kv_cache_manager.free(seq)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        seq.finish(reason)
        del self._seqs[seq.seq_id]

    def _finish_quietly(self, seq: Sequence, reason: FinishReason) -> list[CompletionOutput]:
        """Retire seq; a final, empty delta for each choice it stood for."""
        self._retire(seq, reason)
        return seq.final_completions()

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        seqs = request.unfinished_sequences()
        completions = [c for seq in seqs for c in self._finish_quietly(seq, FinishReason.ERROR)]
        return self._request_output(request, completions, error=message)

    def _request_output(
        self, request: Request, completions: list[CompletionOutput], error: str | None = None
    ) -> RequestOutput:
        """The delta for `request`; forgets the request once every choice has finished."""
        if request.is_finished:
            del self._requests[request.request_id]
            self._finished_request_ids.append(request.request_id)
        return request.make_output(completions, error)

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id
