"""A fake model runner over simulated KV memory, and the helpers that drive the scheduler with
it (no torch). Used by the scheduler tests (tests/engine/core) and the prefix-cache tests
(tests/engine/kv).

The fake model: output token t of a choice is a pure function of (its prompt, its seed, t),
like the real sampler's draw (invariant 4). The runner computes it from what the scheduler
hands it (the SampleSpec's prompt, seeds and output_index) and the oracle from the request
alone, so a token drawn at the wrong output index, or a choice that gets another choice's
token, shows up as a wrong output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.batch import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from engine.core.protocol import EngineRequest, FinishReason, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.seeds import derive_seed
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager

VOCAB = 64
BLOCK_SIZE = 4
EOS_TOKEN_IDS = tuple(range(6))  # property tests: about one sampled token in ten ends a choice


def next_token(prompt: Sequence[int], seed: int, output_index: int) -> int:
    """The fake model's output token `output_index` (t) for a choice seeded `seed`.

    With seed 0 a choice counts on from its prompt's last token (prompt [.., 6] gives 7, 8,
    9, ...), which keeps the scenario tests' numbers readable.
    """
    return (prompt[-1] + 1 + output_index + seed) % VOCAB


def expected_outputs(prompt: list[int], seed: int, num_tokens: int) -> list[int]:
    """The first `num_tokens` outputs of a choice seeded `seed` (already derived per choice)."""
    return [next_token(prompt, seed, t) for t in range(num_tokens)]


class FakeRunner:
    """Simulated KV memory holding one token id per slot.

    Each step it applies the block copies, writes every scheduled token into its slot, then
    reads each scheduled sequence's whole context back through its block table and checks it
    against the sequence's tokens: a sharing, copy-on-write or slot bug shows up there. The
    sampled tokens come from next_token(spec prompt, seed, spec output_index).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        pool = scheduler.kv_cache_manager.pool
        self.scheduler = scheduler
        self.kv: list[int | None] = [None] * (pool.num_blocks * pool.block_size)
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        blocks = [self._block(copy.src) for copy in out.block_copies]  # gather, then scatter
        for copy, content in zip(out.block_copies, blocks, strict=True):
            self.kv[copy.dst * BLOCK_SIZE : (copy.dst + 1) * BLOCK_SIZE] = content
        tokens = [token for scheduled in out.seqs for token in scheduled.token_ids]
        assert len(tokens) == len(out.slot_mapping)
        for slot, token in zip(out.slot_mapping, tokens, strict=True):
            self.kv[slot] = token
        return ModelRunnerOutput({s.seq_id: self._sample(s) for s in out.seqs if s.sample})

    def _block(self, block_id: int) -> list[int | None]:
        return self.kv[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE]

    def _sample(self, scheduled: ScheduledSeq) -> list[SampledToken]:
        context = [
            self.kv[scheduled.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE]
            for p in range(scheduled.context_len)
        ]
        seq = self.scheduler.get_seq(scheduled.seq_id)
        assert context == seq.token_slice(0, scheduled.context_len), f"seq {seq.seq_id}"
        spec = scheduled.sample
        sampled = [
            SampledToken(next_token(spec.prompt_token_ids, seed, spec.output_index))
            for seed in spec.seeds
        ]
        if spec.sampling_params.logprobs is not None:
            for token in sampled:
                token.logprob, token.top_logprobs = -0.5, [(token.token_id, -0.5)]
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    eos_token_ids: tuple[int, ...] = (),
    enable_prefix_cache: bool = False,
    scheduling_policy: str = "fcfs",
    **options: Any,
) -> tuple[Scheduler, FakeRunner]:
    """`options`: other Scheduler keyword arguments (fair_share_prefill_tokens, clock...)."""
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    manager = KVCacheManager(pool, enable_prefix_cache=enable_prefix_cache)
    scheduler = Scheduler(
        manager,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        eos_token_ids,
        weights_version="w0",
        scheduling_policy=scheduling_policy,
        **options,
    )
    return scheduler, FakeRunner(scheduler)


def params(**overrides) -> SamplingParams:
    settings = dict(seed=0, max_tokens=4, ignore_eos=True)
    settings.update(overrides)
    return SamplingParams(**settings)


def step(scheduler: Scheduler, runner: FakeRunner) -> list[RequestOutput]:
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_integrity()
    return outputs


@dataclass
class Collected:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    reasons: dict[int, FinishReason] = field(default_factory=dict)
    stop_token_ids: dict[int, int | None] = field(default_factory=dict)
    error: str | None = None
    finished: bool = False
    num_cached_tokens: int = 0


def collect(results: dict[str, Collected], outputs: list[RequestOutput]) -> None:
    for output in outputs:
        result = results.setdefault(output.request_id, Collected())
        assert not result.finished, f"{output.request_id} got output after finishing"
        result.finished, result.error = output.finished, output.error
        result.num_cached_tokens = output.num_cached_tokens
        for choice in output.outputs:
            assert choice.index not in result.reasons, "a finished choice got more output"
            result.tokens.setdefault(choice.index, []).extend(choice.new_token_ids)
            if choice.finish_reason is not None:
                result.reasons[choice.index] = choice.finish_reason
                result.stop_token_ids[choice.index] = choice.stop_token_id


def run(
    scheduler: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[EngineRequest]],
    results: dict[str, Collected] | None = None,
    max_steps: int = 500,
) -> dict[str, Collected]:
    """Add arrivals[k] before step k; step until every request finished; no sequence holds
    a block (each is free or cached by the prefix tree alone).

    `results` carries what earlier, hand-driven steps collected.
    """
    results = {} if results is None else results
    for index in range(max_steps):
        for request in arrivals.get(index, []):
            scheduler.add_request(request)
        if index > max(arrivals, default=0) and not scheduler.has_unfinished_requests():
            break
        collect(results, step(scheduler, runner))
    assert not scheduler.has_unfinished_requests()
    assert all(result.finished for result in results.values())
    pool = scheduler.kv_cache_manager.pool
    held = [b for b in range(pool.num_blocks) if pool.refcount(b)]
    assert all(pool.is_tree_owned(b) and pool.refcount(b) == 1 for b in held)
    assert scheduler.num_leaked_blocks() == 0
    return results


def check_outputs(state: dict) -> None:
    """The property tests' oracle. state["requests"]: request id -> (prompt, params);
    state["results"]: request id -> Collected. Every choice's tokens are what its prompt and
    seed alone give, at their output index; STOP and LENGTH agree with the stop rules."""
    for request_id, result in state["results"].items():
        prompt, params = state["requests"][request_id]
        for index, tokens in result.tokens.items():
            choice_seed = derive_seed(params.seed, index)
            assert tokens == expected_outputs(prompt, choice_seed, len(tokens)), request_id
            assert len(tokens) <= params.max_tokens
            stoppable = [] if params.ignore_eos else tokens[params.min_tokens :]
            reason = result.reasons.get(index)
            if reason is FinishReason.STOP:
                assert tokens[-1] in EOS_TOKEN_IDS and stoppable[-1] == tokens[-1]
                assert result.stop_token_ids[index] == tokens[-1]
            if reason is FinishReason.LENGTH:
                assert not set(stoppable) & set(EOS_TOKEN_IDS), request_id
