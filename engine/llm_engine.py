"""Synchronous engine: add_request / step / abort. Usable offline and by AsyncEngine's thread."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.audit.auditor import Auditor
from engine.audit.faults import FaultInjector
from engine.core.batch import ModelRunnerOutput, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.errors import FaultInjectionDisabled, KVEventsDisabled
from engine.core.protocol import (
    AdmittedRequest,
    EngineRequest,
    EngineStats,
    FaultReport,
    FinishReason,
    ModelInfo,
    RequestOutput,
    StepSample,
)
from engine.core.sampling_params import SamplingParams
from engine.core.spec_ngram import NgramProposer
from engine.core.validation import validate_request
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_events import KVEvent
from engine.runtime.grammar import GrammarCache
from engine.runtime.model_runner import LaunchedStep, ModelRunner
from engine.sched.fair_share import FairShareWeights
from engine.sched.scheduler import Scheduler
from engine.tier_setup import build_kv_tier, save_cached_blocks, tier_figures

if TYPE_CHECKING:
    from engine.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)

_MAX_RECENT_STEPS = 10_000
_IDLE_READ_WAIT_S = 0.005  # an empty step waits this long at most for a tier read in flight


@dataclass
class _InFlight:
    """A step the runner has queued, and its schedule."""

    sched_out: SchedulerOutput
    launched: LaunchedStep


def resolve_async_scheduling(setting: str, runner: ModelRunner) -> bool:
    """EngineConfig.async_scheduling: auto is on where a CUDA device runs the steps (the host
    schedules while it works), off on the CPU (the same cores would do both)."""
    if setting == "auto":
        return runner.device.type == "cuda"
    return setting == "on"


@dataclass
class GenerationResult:
    """What LLMEngine.generate() returns per prompt: one entry per choice."""

    token_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None


class LLMEngine:
    """Owns the model runner, the KV cache manager and the scheduler; one step at a time.

    Not thread-safe: one thread drives add_request/abort_request/step/inject_fault. After
    every step it publishes an immutable EngineStats as `latest_stats` (one reference
    assignment); that snapshot is the only thing another thread may read, and readers never
    call into the engine for figures. step_samples keeps the recent steps for offline drivers
    on the same thread (benchmarks).

    The cache auditor (engine/audit/auditor.py) runs inside step(): after the model step, with the
    token budget the step left. has_unfinished_requests() stays True while audits are queued,
    so a driver that steps until it is False also finishes them.

    KV events (config.kv_events_endpoint; off by default): the prefix cache appends its events
    to a list during the step; at the end of the step they go to the publisher as one batch
    (a queue put: the publisher thread encodes and sends). close() stops the publisher.

    Structured output: `grammar_cache` (engine/runtime/grammar.py) is the one object another
    thread may call (it is thread-safe): AsyncEngine compiles a request's grammar there before
    queuing it and hands the result to add_request; offline, add_request compiles it itself.
    The runner's grammar_matchers then mask that request's draws until it finishes.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_info: ModelInfo = self.runner.model_info
        self.grammar_cache = GrammarCache(self.model_info, config)  # thread-safe
        self._kv_events: list[KVEvent] = []  # this step's, until _publish hands them over
        self.kv_event_publisher = self._build_kv_event_publisher()
        self.kv_tier = build_kv_tier(config, self.runner)  # None: no second tier
        self.kv_cache_manager = self._build_kv_cache_manager()
        self.scheduler = self._build_scheduler()
        self.auditor = Auditor(config, self.runner, self.kv_cache_manager, self.scheduler.get_seq)
        self.faults = FaultInjector(
            self.kv_cache_manager, self.runner.kv_caches, self.kv_tier
        )  # drills only
        self.step_samples: deque[StepSample] = deque(maxlen=_MAX_RECENT_STEPS)
        self._num_steps = 0
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, self.runner)
        self._in_flight: _InFlight | None = None  # a lookahead step queued by the last step()
        self.latest_stats = self._snapshot(None)

    def _build_kv_event_publisher(self) -> KVEventPublisher | None:
        if not self.config.kv_events_endpoint:
            return None  # off: zmq is not even imported
        from engine.kv_event_publisher import KVEventPublisher

        if not self.config.enable_prefix_cache:
            logger.warning("KV events are on but the prefix cache is off: nothing to publish")
        publisher = KVEventPublisher(
            self.config.kv_events_endpoint,
            topic=self.config.kv_events_topic,
            queue_size=self.config.kv_events_queue_size,
            curve_secret_key_file=self.config.kv_events_curve_secret_key_file,
            curve_clients_dir=self.config.kv_events_curve_clients_dir,
        )
        logger.info("publishing KV events on %s", publisher.endpoint)
        return publisher

    def _build_kv_cache_manager(self) -> KVCacheManager:
        pool = BlockPool(self.runner.num_kv_blocks, self.runner.block_size)
        sink = self._kv_events.append if self.kv_event_publisher is not None else None
        return KVCacheManager(
            pool,
            enable_prefix_cache=self.config.enable_prefix_cache,
            kv_event_sink=sink,
            max_cached_blocks_per_namespace=self.config.max_cached_blocks_per_namespace,
            tier=self.kv_tier,
        )

    def _build_scheduler(self) -> Scheduler:
        return Scheduler(
            self.kv_cache_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.model_info.max_model_len,
            eos_token_ids=self.model_info.eos_token_ids,
            weights_version=self.model_info.weights_version,
            scheduling_policy=self.config.scheduling_policy,
            record_cache_hits=self.config.audit_sample_rate > 0
            or (self.kv_tier is not None and self.config.audit_restored_sample_rate > 0),
            proposer=self._build_proposer(),
            speculative_max_decodes=self.config.speculative_max_decodes,
            fair_share_weights=FairShareWeights(
                prompt=self.config.fair_share_prompt_weight,
                cached_prompt=self.config.fair_share_cached_prompt_weight,
                output=self.config.fair_share_output_weight,
            ),
            fair_share_prefill_tokens=self.config.fair_share_prefill_tokens,
            fair_share_active_seconds=self.config.fair_share_active_seconds,
        )

    def _build_proposer(self) -> NgramProposer | None:
        config = self.config
        if config.speculative_ngram_tokens == 0:
            return None
        return NgramProposer(
            config.speculative_ngram_tokens,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
        )

    # -- requests -----------------------------------------------------------------------
    def admit(self, request: EngineRequest, prompt_param: str = "prompt") -> AdmittedRequest:
        """Check `request` against the model (ParamError names a bad field; `prompt_param` the
        prompt's) and compile its grammar (structured output; ParamError on response_format,
        ignore_eos or min_tokens). The one check and the one compile of every request:
        AsyncEngine calls it from a worker thread (GrammarCache is thread-safe)."""
        validate_request(request, self.model_info, prompt_param=prompt_param)
        params = request.sampling_params
        if params.structured is None:
            return AdmittedRequest(request)
        grammar = self.grammar_cache.compile_for(params, request.cache_salt, request.tenant)
        return AdmittedRequest(request, grammar)

    def add_request(self, request: EngineRequest) -> None:
        """admit() `request`, then queue it (the offline edge; nothing is queued on a
        ParamError)."""
        self.add_admitted(self.admit(request))

    def add_admitted(self, admitted: AdmittedRequest) -> None:
        """Queue an admitted request. The scheduler still asserts what its own state depends
        on (a unique id, a prompt that fits the context window)."""
        request = admitted.request
        self.scheduler.add_request(request)
        if request.sampling_params.structured is not None:
            # Release finished requests first: this id may be a finished one's, not yet dropped.
            self.runner.grammar_matchers.release(self.scheduler.take_finished_request_ids())
            kind = request.sampling_params.structured.kind
            self.runner.grammar_matchers.register(request.request_id, kind, admitted.grammar)

    def abort_request(
        self, request_id: str, choice_index: int | None = None
    ) -> list[RequestOutput]:
        output = self.scheduler.abort_request(request_id, choice_index)
        return [output] if output is not None else []

    def has_unfinished_requests(self) -> bool:
        """Requests (or cache audits, or a step in flight) are still in progress."""
        return (
            self.scheduler.has_unfinished_requests()
            or self.auditor.num_pending > 0
            or self._in_flight is not None
        )

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the deltas of every touched request.

        An exception inside the model fails only the sequences of this batch; the engine
        stays usable for everything else.

        Async scheduling (engine/sched/lookahead.py): where the outputs allow it, the next
        step is scheduled and queued before this one's tokens are read, and the next step()
        call starts from it instead of scheduling. Each call still returns one step's deltas.
        """
        started = time.perf_counter()
        current, self._in_flight = self._in_flight, None
        if current is None:
            try:
                sched_out = self.scheduler.schedule()
            except Exception:  # what it loaded or spilled before failing never reaches a runner
                self.kv_cache_manager.drop_pending_transfers()
                raise
            self.auditor.start(self.scheduler.take_cache_hits())  # before execute: logits kept
            if sched_out.is_empty and not sched_out.has_transfers:
                return self._idle_step(sched_out)
            try:
                current = _InFlight(sched_out, self.runner.launch(sched_out))
            except Exception as exc:  # an engine fault: fail what it touched, keep serving
                return self._fail_step(sched_out, exc)
        outputs = self._launch_lookahead(current)
        try:
            runner_out = current.launched.result()
        except Exception as exc:
            dropped, self._in_flight = self._in_flight, None
            if dropped is not None:  # queued behind it, on its sequences: failed with them
                self.scheduler.drop_lookahead()
                outputs += self._fail_step(dropped.sched_out, exc, publish=False)
            return outputs + self._fail_step(current.sched_out, exc)
        outputs += self.scheduler.update_from_output(current.sched_out, runner_out)
        self._run_audits(current.sched_out)
        sample = StepSample(
            duration_s=time.perf_counter() - started,
            num_seqs=len(current.sched_out.seqs),
            num_tokens=current.sched_out.num_batched_tokens,
        )
        self.step_samples.append(sample)
        self._publish(sample)
        return outputs

    def _launch_lookahead(self, current: _InFlight) -> list[RequestOutput]:
        """Schedule and queue the step after `current` where async scheduling is on and the
        outputs allow it (it becomes _in_flight); the deltas of a lookahead that failed."""
        if not self.async_scheduling or self.auditor.num_pending:
            return []
        if current.launched.token_ids is None:
            return []
        try:
            sched_out = self.scheduler.schedule_lookahead(current.sched_out)
        except Exception as exc:  # a bug: copies it recorded may not be made, fail their seqs
            logger.exception("scheduling a lookahead step failed")
            self.scheduler.drop_lookahead()
            self.kv_cache_manager.take_block_copies()
            self.kv_cache_manager.drop_pending_transfers()
            message = f"engine fault while scheduling: {type(exc).__name__}: {exc}"
            return self.scheduler.fail_seqs([s.seq_id for s in current.sched_out.seqs], message)
        if sched_out is None:
            return []
        try:
            self._in_flight = _InFlight(sched_out, self.runner.launch(sched_out, current.launched))
        except Exception as exc:  # its copies may not be made: fail its sequences
            self.scheduler.drop_lookahead()
            return self._fail_step(sched_out, exc, publish=False)
        return []

    def _idle_step(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """A step with nothing to run: requests the scheduler finished without running (e.g.
        never fit) still report."""
        self.runner.grammar_matchers.release(sched_out.finished_request_ids)
        outputs = self.scheduler.update_from_output(sched_out, ModelRunnerOutput())
        self._run_audits(sched_out)
        self._publish(None)
        if not outputs:  # nothing ran: a request may wait on its tier blocks being read
            self.kv_cache_manager.wait_for_tier_reads(_IDLE_READ_WAIT_S)
        return outputs

    def _fail_step(
        self, sched_out: SchedulerOutput, exc: Exception, publish: bool = True
    ) -> list[RequestOutput]:
        """An engine fault in a step: fail its sequences, give back its transfers."""
        logger.error("model step failed; failing %d sequences", len(sched_out.seqs), exc_info=exc)
        message = f"engine fault while running the model: {type(exc).__name__}: {exc}"
        self.kv_cache_manager.store_spilled(sched_out.block_spills, [])  # counted as lost
        self.kv_cache_manager.drop_unwritten(sched_out.block_loads)  # they hold no KV
        self.auditor.drop_reading({load.block_id for load in sched_out.block_loads})
        outputs = self.scheduler.fail_seqs([s.seq_id for s in sched_out.seqs], message)
        if publish:
            self._publish(None)
        return outputs

    def _run_audits(self, sched_out: SchedulerOutput) -> None:
        """Audit work in the budget this step left; an audit failure never fails requests."""
        if not self.auditor.num_pending:
            return
        num_spare_blocks = self.scheduler.num_running
        try:
            self.auditor.run(sched_out.num_spare_tokens, num_spare_blocks=num_spare_blocks)
        except Exception:
            logger.exception("prefix-cache audit failed; dropping the queued audits")
            self.auditor.drop_all()

    def inject_fault(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        """Fault drill (between steps): corrupt_block | wrong_block, see engine/audit/faults.py.

        Raises FaultInjectionDisabled unless config.enable_fault_injection, UnknownFaultKind
        for an unknown kind, InvalidFaultTarget for a target that is not cached.
        """
        if not self.config.enable_fault_injection:
            raise FaultInjectionDisabled(
                "fault injection is disabled; start the engine with enable_fault_injection "
                "(kvshare serve --enable-fault-injection)"
            )
        report = self.faults.inject(kind, block_id, other_block_id)
        logger.warning("fault injected: %s", report.detail)
        return report

    def kv_block_hashes(self) -> list[int]:
        """The KV event hash of every cached block, sorted (between steps). The events behind
        it are queued first, so a subscriber that applied every event holds this set. Raises
        KVEventsDisabled unless config.kv_events_endpoint is set."""
        if self.kv_event_publisher is None:
            raise KVEventsDisabled(
                "KV events are disabled; start the engine with kv_events_endpoint "
                "(kvshare serve --kv-events-endpoint tcp://127.0.0.1:5557)"
            )
        self._flush_kv_events()
        return self.kv_cache_manager.cached_block_hashes()

    def close(self) -> None:
        """Stop what runs beside the engine (the KV event publisher, after sending what is
        queued; the second tier, after writing the pool's cached blocks to it when it is on
        disk with warm restart). Safe to call again. A step in flight is applied first."""
        self._apply_in_flight()
        if self.kv_tier is not None and not self.kv_tier.is_closed:
            if self.kv_cache_manager.tier_link is not None:
                self.kv_cache_manager.tier_link.close()
            if self.kv_tier.store.persistent and self.config.kv_tier_warm_restart:
                self.save_cached_blocks()
            self.kv_tier.close()
        self.grammar_cache.close()
        if self.kv_event_publisher is not None:
            self._flush_kv_events()
            self.kv_event_publisher.close()

    def _apply_in_flight(self) -> None:
        """Wait for the lookahead step in flight, if any, and apply it (its deltas go nowhere:
        only close() calls this)."""
        current, self._in_flight = self._in_flight, None
        if current is None:
            return
        try:
            runner_out = current.launched.result()
        except Exception:
            logger.exception("the step in flight at close failed")
            self.scheduler.fail_seqs([s.seq_id for s in current.sched_out.seqs], "engine closed")
            return
        self.scheduler.update_from_output(current.sched_out, runner_out)

    def save_cached_blocks(self) -> int:
        """Write the prefix tree's blocks the second tier lacks into it and wait for the
        store; returns how many (engine/tier_setup.py)."""
        return save_cached_blocks(self.kv_cache_manager, self.runner, self.kv_tier)

    # -- offline convenience ------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams],
    ) -> list[GenerationResult]:
        """Run prompts (token ids) to completion; results in prompt order."""
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        request_ids = [f"offline-{id(self)}-{i}" for i in range(len(prompts))]
        requests = [
            EngineRequest(request_id, list(prompt), param)
            for request_id, prompt, param in zip(request_ids, prompts, params, strict=True)
        ]
        admitted = [self.admit(request) for request in requests]  # a bad one queues nothing
        results = {}
        for one, prompt, param in zip(admitted, prompts, params, strict=True):
            request_id = one.request.request_id
            self.add_admitted(one)
            results[request_id] = GenerationResult(
                token_ids=[[] for _ in range(param.n)],
                finish_reasons=[None] * param.n,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=0,
            )
        while self.has_unfinished_requests():
            for output in self.step():
                _accumulate(results[output.request_id], output)
        return [results[request_id] for request_id in request_ids]

    # -- figures --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The snapshot published after the last step (see latest_stats)."""
        return self.latest_stats

    def _publish(self, step: StepSample | None) -> None:
        """End of a step: replace latest_stats by a fresh snapshot (O(1) in pool size)."""
        self._num_steps += step is not None
        if self._kv_events:
            self._flush_kv_events()
        self.latest_stats = self._snapshot(step)

    def _flush_kv_events(self) -> None:
        """Hand the events recorded so far to the publisher as one batch."""
        if self._kv_events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self._kv_events.copy())
            self._kv_events.clear()  # the same list: the cache's sink is its append

    def _snapshot(self, step: StepSample | None) -> EngineStats:
        audits = self.auditor.counters
        return self.scheduler.stats(
            bytes_per_block=self.runner.bytes_per_block,
            num_audits=audits.num_audits,
            num_audit_corruptions=audits.num_corruptions,
            num_audit_drifts=audits.num_drifts,
            num_audits_dropped=audits.num_dropped,
            num_steps=self._num_steps,
            step=step,
            audit_max_abs_diffs=tuple(self.auditor.drain_recent_max_abs_diffs()),
            **self._kv_event_counters(),
            **tier_figures(self.kv_tier, self.kv_cache_manager, self.auditor.counters),
            **self._grammar_figures(),
        )

    def _grammar_figures(self) -> dict[str, Any]:
        matchers, cache = self.runner.grammar_matchers, self.grammar_cache
        return {
            "num_structured_json_object_requests": matchers.num_requests_by_kind["json_object"],
            "num_structured_json_schema_requests": matchers.num_requests_by_kind["json_schema"],
            "num_structured_tool_calls_requests": matchers.num_requests_by_kind["tool_calls"],
            "num_grammar_cache_hits": cache.num_cache_hits,
            "num_grammar_compile_failures": cache.num_compile_failures,
            "grammar_compile_seconds": tuple(cache.drain_compile_seconds()),
            "grammar_mask_seconds": matchers.take_mask_seconds(),
        }

    def _kv_event_counters(self) -> dict[str, int]:
        publisher = self.kv_event_publisher
        if publisher is None:
            return {}
        return {
            "num_kv_events_published": publisher.num_published_events,
            "num_kv_events_dropped": publisher.num_dropped_events,
        }


def _accumulate(result: GenerationResult, output: RequestOutput) -> None:
    result.num_cached_tokens = output.num_cached_tokens
    if output.error is not None:
        result.error = output.error
    for choice in output.outputs:
        result.token_ids[choice.index].extend(choice.new_token_ids)
        if choice.finish_reason is not None:
            result.finish_reasons[choice.index] = choice.finish_reason
