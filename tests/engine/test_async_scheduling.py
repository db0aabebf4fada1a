"""Async scheduling (engine/sched/lookahead.py) on the tiny random Llama: the same deltas as
synchronous steps, HF's greedy tokens, and every block back, whatever stops, aborts or fails
while a lookahead step is in flight. The CPU runs each step to the end before the next is
queued, so what these tests check is the bookkeeping; the GPU check times the overlap."""

from __future__ import annotations

import pytest

from engine.core.batch import PLACEHOLDER_TOKEN
from engine.core.protocol import EngineRequest, FinishReason
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.model_runner import LaunchedStep
from tests.engine.engine_helpers import (
    assert_all_blocks_free,
    make_engine,
    random_prompts,
    run_checked,
)
from tests.oracle import hf_greedy

# tiny_model_dir and hf_model: tests/engine/conftest.py


def count_lookaheads(engine: LLMEngine) -> list[list[int]]:
    """Record the previous_token_rows of every lookahead step the engine schedules; each has
    rows, on placeholders, none of them penalised (a penalty reads the output tokens)."""
    scheduled: list[list[int]] = []
    schedule_lookahead = engine.scheduler.schedule_lookahead

    def counted(previous):
        out = schedule_lookahead(previous)
        if out is not None:
            scheduled.append(out.previous_token_rows)
            assert out.seqs and all(s.token_ids == [PLACEHOLDER_TOKEN] for s in out.seqs)
            for seq in out.seqs:
                params = seq.sample.sampling_params
                assert params.presence_penalty == params.frequency_penalty == 0.0
        return out

    engine.scheduler.schedule_lookahead = counted
    return scheduled


def mixed_requests() -> dict[int, list[EngineRequest]]:
    """Requests arriving over the first steps, with greedy and seeded draws, n=2, logprobs,
    presence and frequency penalties (no lookahead while they run: the text would change),
    lengths that cross block boundaries, and stop tokens that end a sequence while its next
    decode is in flight."""
    prompts = random_prompts(16, seed=11, min_len=3, max_len=40)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=17, n=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=30, stop_token_ids=[40, 41, 42, 43]),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=21, frequency_penalty=2.0,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=26, presence_penalty=2.0, ignore_eos=True),
    ]  # fmt: skip
    requests: dict[int, list[EngineRequest]] = {}
    for i, prompt in enumerate(prompts):
        params = kinds[i % len(kinds)]
        arrival = [0, 0, 0, 3, 9, 25, 40, 41][i % 8] + i // 8
        requests.setdefault(arrival, []).append(EngineRequest(f"r{i}", prompt, params))
    return requests


def test_lookahead_steps_give_the_synchronous_deltas(tiny_model_dir, hf_model):
    synchronous = run_checked(make_engine(tiny_model_dir), mixed_requests())
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    lookaheads = count_lookaheads(engine)
    assert run_checked(engine, mixed_requests()) == synchronous
    assert len(lookaheads) >= 20  # most decode steps of the run were scheduled ahead
    for i in (0, 8):  # greedy, 40 tokens: HF's
        prompt = random_prompts(16, seed=11, min_len=3, max_len=40)[i]
        assert synchronous[f"r{i}"][0] == hf_greedy(hf_model, prompt, 40)


def test_a_stop_on_the_token_in_flight_ends_the_text_there(tiny_model_dir, hf_model):
    prompt = random_prompts(1, seed=4)[0]
    expected = hf_greedy(hf_model, prompt, 24)
    stop = expected[9]
    first = expected.index(stop)
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    lookaheads = count_lookaheads(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    result = engine.generate([prompt], greedy)[0]
    assert result.token_ids[0] == expected[: first + 1]
    assert result.finish_reasons == [FinishReason.STOP]
    assert len(lookaheads) == first  # the row queued after the stop token is dropped
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_a_follow_up_reuses_the_cache_of_a_text_stopped_in_flight(tiny_model_dir, hf_model):
    """Turn two's prompt is turn one's prompt and answer, which stopped on a token while its
    next row was queued: turn one's cached blocks serve turn two, the audit (every hit) finds
    them clean, and both texts are the synchronous steps'."""
    prompt = random_prompts(1, seed=17, min_len=30, max_len=30)[0]
    stop = hf_greedy(hf_model, prompt, 40)[13]
    turn_one = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    turn_two = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("off", "on"):
        engine = make_engine(
            tiny_model_dir, async_scheduling=mode, audit_sample_rate=1.0, block_size=8
        )
        first = engine.generate([prompt], turn_one)[0]
        follow_up = prompt + first.token_ids[0] + [5, 6, 7]
        second = engine.generate([follow_up], turn_two)[0]
        stats = engine.stats()
        assert stats.num_audits == 1 and stats.num_audit_corruptions == 0
        assert stats.num_audit_drifts == 0
        assert_all_blocks_free(engine)
        runs[mode] = (first.token_ids, first.finish_reasons, second.token_ids)
        runs[mode, "cached"] = second.num_cached_tokens
        runs[mode, "lookaheads"] = stats.num_lookahead_steps
    assert runs["on"] == runs["off"]
    assert runs["on"][1] == [FinishReason.STOP] and len(runs["on"][0][0]) >= 3
    assert runs["on", "cached"] == runs["off", "cached"] >= len(prompt)
    assert runs["off", "lookaheads"] == 0 < runs["on", "lookaheads"]


def test_a_request_that_arrives_while_a_lookahead_runs_is_admitted_next(tiny_model_dir):
    """No lookahead is queued behind the step in flight once a request waits: the next call
    applies that step, the one after admits the request."""
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("first", random_prompts(1, seed=15)[0], params))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.add_request(EngineRequest("later", random_prompts(1, seed=16)[0], params))
    applied = engine.step()
    assert [o.request_id for o in applied] == ["first"] and engine._in_flight is None
    admitted = engine.step()
    assert {o.request_id for o in admitted} == {"first", "later"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_a_backlog_waiting_for_seats_decodes_on_lookaheads(tiny_model_dir):
    """Every seat taken and requests waiting: the synchronous schedule would admit none, so
    lookahead steps run. A seat that a max_tokens finish frees is known ahead, so no lookahead
    runs past it: each request starts at the same step as without them, with the same text."""
    prompts = random_prompts(6, seed=18)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=8 + 5 * i,
                       ignore_eos=True)
        for i in range(6)
    ]  # fmt: skip
    runs, first_token_calls = {}, {}
    for mode in ("off", "on"):
        engine = make_engine(tiny_model_dir, async_scheduling=mode, max_num_seqs=2)
        waiting_at_lookahead = []
        schedule_lookahead = engine.scheduler.schedule_lookahead

        def counted(previous, engine=engine, seen=waiting_at_lookahead, f=schedule_lookahead):
            out = f(previous)
            if out is not None:
                seen.append(engine.scheduler.num_waiting)
            return out

        engine.scheduler.schedule_lookahead = counted
        for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(EngineRequest(f"q{i}", prompt, param))
        tokens, firsts, calls = {}, {}, 0
        while engine.has_unfinished_requests():
            calls += 1
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.outputs[0].new_token_ids)
                firsts.setdefault(output.request_id, calls)
        runs[mode] = tokens
        first_token_calls[mode] = firsts
        if mode == "on":
            assert sum(1 for waiting in waiting_at_lookahead if waiting > 0) >= 10
        assert_all_blocks_free(engine)
    assert runs["on"] == runs["off"]
    assert first_token_calls["on"] == first_token_calls["off"]


def test_an_abort_while_a_lookahead_runs_frees_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    prompts = random_prompts(2, seed=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"a{i}", prompt, params))
    counts = {"a0": 0, "a1": 0}
    for _ in range(6):
        for output in engine.step():
            counts[output.request_id] += sum(len(c.new_token_ids) for c in output.outputs)
    assert engine._in_flight is not None  # a lookahead step is queued
    (aborted,) = engine.abort_request("a0")
    assert aborted.outputs[0].finish_reason is FinishReason.ABORT
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "a1"  # nothing more of the aborted one
            counts["a1"] += sum(len(c.new_token_ids) for c in output.outputs)
    assert counts == {"a0": 6, "a1": 50}  # a prefill step, then five decodes
    engine.scheduler.check_integrity()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_fault_in_a_lookahead_fails_its_requests_only(tiny_model_dir, where):
    """A lookahead step that fails to launch, or a step whose tokens fail to arrive while a
    lookahead is queued behind it: its requests end with an error, a later one is served."""
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    launch = engine.runner.launch
    calls = {"n": 0}

    def failing(sched_out, previous=None):
        calls["n"] += 1
        if where == "launch" and previous is not None and calls["n"] > 4:
            raise RuntimeError("injected launch fault")
        launched = launch(sched_out, previous)
        if where == "result" and previous is not None and calls["n"] > 4:
            return LaunchedStep(launched.token_ids, _raise)
        return launched

    engine.runner.launch = failing
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = engine.generate(random_prompts(3, seed=9), params)
    assert all(r.error and "injected" in r.error for r in results)
    assert_all_blocks_free(engine)
    engine.runner.launch = launch
    (later,) = engine.generate(random_prompts(1, seed=10), params)
    assert later.error is None and len(later.token_ids[0]) == 20
    assert_all_blocks_free(engine)


def _raise():
    raise RuntimeError("injected result fault")


def test_a_seeded_request_reads_the_same_alone_and_in_a_crowd(tiny_model_dir):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=30, ignore_eos=True)
    prompt = random_prompts(1, seed=12)[0]
    engine = make_engine(tiny_model_dir, async_scheduling="on")
    alone = engine.generate([prompt], seeded)[0].token_ids
    crowd = random_prompts(7, seed=13)
    others = [SamplingParams(temperature=0.9, seed=i, max_tokens=10 + 3 * i) for i in range(7)]
    together = engine.generate([*crowd[:3], prompt, *crowd[3:]], [*others[:3], seeded, *others[3:]])
    assert together[3].token_ids == alone
    assert_all_blocks_free(engine)


def test_a_pool_short_of_blocks_falls_back_to_scheduling(tiny_model_dir):
    """Eight sequences growing past a 24-block pool: lookahead steps stop where a block is
    short, preemption and recompute happen in synchronous steps, the text is unchanged."""
    prompts = random_prompts(8, seed=14, min_len=20, max_len=40)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {0: [EngineRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)]}
    synchronous = run_checked(make_engine(tiny_model_dir, num_kv_blocks=24), requests)
    engine = make_engine(tiny_model_dir, num_kv_blocks=24, async_scheduling="on")
    lookaheads = count_lookaheads(engine)
    assert run_checked(engine, requests) == synchronous
    assert engine.scheduler.counters.num_preemptions > 0
    assert lookaheads


def test_auto_is_off_on_the_cpu(tiny_model_dir):
    assert make_engine(tiny_model_dir).async_scheduling is False
    assert make_engine(tiny_model_dir, async_scheduling="on").async_scheduling is True
