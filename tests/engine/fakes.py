"""The oracles and helpers that drive the scheduler with the simulated runner of
engine/simulation.py (no torch). Used by the scheduler tests (tests/engine/sched) and the
prefix-cache tests (tests/engine/kv).

The oracle computes a choice's tokens from the request alone (its prompt and seed), the runner
from what the scheduler hands it, so a token drawn at the wrong output index, or a choice that
gets another choice's token, shows up as a wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.protocol import EngineRequest, FinishReason, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.seeds import derive_seed
from engine.sched.scheduler import Scheduler
from engine.simulation import SimulatedRunner, next_token

EOS_TOKEN_IDS = tuple(range(6))  # property tests: about one sampled token in ten ends a choice


def expected_outputs(prompt: list[int], seed: int, num_tokens: int) -> list[int]:
    """The first `num_tokens` outputs of a choice seeded `seed` (already derived per choice)."""
    return [next_token(prompt, seed, t) for t in range(num_tokens)]


def params(**overrides) -> SamplingParams:
    settings = dict(seed=0, max_tokens=4, ignore_eos=True)
    settings.update(overrides)
    return SamplingParams(**settings)


def step(scheduler: Scheduler, runner: SimulatedRunner) -> list[RequestOutput]:
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
    runner: SimulatedRunner,
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
