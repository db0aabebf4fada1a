"""Scheduler scenarios driven by a fake runner over simulated KV memory (no torch)."""

from __future__ import annotations

import pytest

from engine.core.batch import BlockCopy, ModelRunnerOutput, SchedulerOutput
from engine.core.errors import ChoiceNotForked
from engine.core.protocol import (
    CompletionOutput,
    EngineRequest,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from engine.core.sampling_params import SamplingParams
from engine.core.seeds import derive_seed
from engine.sched.scheduler import Scheduler
from engine.simulation import make_scheduler, next_token
from tests.engine.fakes import Collected, collect, expected_outputs, params, run, step


# -- batching ----------------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    scheduler.add_request(EngineRequest("r", prompt, params(max_tokens=2)))
    results = run(scheduler, runner, {})
    chunks = [
        (s.start_pos, s.token_ids, s.block_ids, s.sample is None) for s in runner.steps[0].seqs
    ]
    assert chunks == [(0, prompt[:8], [0, 1], True)]
    second, third, fourth = (out.seqs[0] for out in runner.steps[1:])
    assert (second.start_pos, second.token_ids, second.block_ids) == (8, prompt[8:16], [0, 1, 2, 3])
    assert (third.start_pos, third.token_ids, third.block_ids) == (16, prompt[16:], [0, 1, 2, 3, 4])
    assert third.sample is not None and third.sample.output_index == 0
    assert [out.slot_mapping for out in runner.steps[:3]] == [
        list(range(8)),
        list(range(8, 16)),
        list(range(16, 20)),
    ]
    assert (fourth.start_pos, fourth.token_ids, fourth.block_ids) == (20, [21], [0, 1, 2, 3, 4, 5])
    assert runner.steps[3].num_decodes == 1 and runner.steps[3].slot_mapping == [20]
    assert results["r"].tokens == {0: [21, 22]}
    assert (scheduler.counters.num_prefill_tokens, scheduler.counters.num_generation_tokens) == (
        20,
        2,
    )


def test_decodes_come_first_then_prefills() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("a", [5, 6, 7], params()))
    step(scheduler, runner)
    scheduler.add_request(EngineRequest("b", list(range(10)), params()))
    step(scheduler, runner)
    out = runner.steps[1]
    assert out.num_decodes == 1
    assert [(s.seq_id, s.start_pos, s.token_ids, s.block_ids) for s in out.seqs] == [
        (0, 3, [8], [0]),
        (1, 0, list(range(10)), [1, 2, 3]),
    ]
    assert out.slot_mapping == [3, *range(4, 14)]


def test_token_budget_caps_decodes_and_chunks_the_rest() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=4)
    for name in "abc":
        scheduler.add_request(EngineRequest(name, [1], params()))
    step(scheduler, runner)  # three one-token prompts
    scheduler.add_request(EngineRequest("d", list(range(6)), params()))
    step(scheduler, runner)
    out = runner.steps[1]
    assert out.num_decodes == 3
    assert [(s.seq_id, s.num_tokens, s.sample is None) for s in out.seqs] == [
        (0, 1, False),
        (1, 1, False),
        (2, 1, False),
        (3, 1, True),
    ]
    assert out.num_batched_tokens == 4


def test_staggered_joins_each_match_their_solo_output() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    prompts = {f"r{i}": [3 * i + j for j in range(2 + 5 * i)] for i in range(6)}
    arrivals: dict[int, list[EngineRequest]] = {}
    for i, (name, prompt) in enumerate(prompts.items()):
        request = EngineRequest(name, prompt, params(max_tokens=3 + i, seed=i))
        arrivals.setdefault(2 * i, []).append(request)
    results = run(scheduler, runner, arrivals)
    for i, (name, prompt) in enumerate(prompts.items()):
        assert results[name].tokens == {0: expected_outputs(prompt, i, 3 + i)}, name
        assert results[name].reasons == {0: FinishReason.LENGTH}
    assert max(len(out.seqs) for out in runner.steps) == 3
    assert all(out.num_batched_tokens <= 10 for out in runner.steps)


# -- preemption --------------------------------------------------------------------------------
def test_preempts_the_newest_and_recomputes_it_later() -> None:
    scheduler, runner = make_scheduler(num_blocks=4)
    a_prompt, b_prompt = list(range(7)), list(range(20, 28))
    scheduler.add_request(EngineRequest("a", a_prompt, params(max_tokens=3)))
    scheduler.add_request(EngineRequest("b", b_prompt, params(max_tokens=2)))
    results: dict[str, Collected] = {}
    collect(results, step(scheduler, runner))  # a: blocks [0, 1]; b: blocks [2, 3]
    collect(results, step(scheduler, runner))  # a decodes at 7; b needs a 5th block: b yields
    assert [s.seq_id for s in runner.steps[1].seqs] == [0]
    assert scheduler.counters.num_preemptions == 1
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    collect(results, step(scheduler, runner))  # a takes block 2 and finishes; b does not fit
    assert runner.steps[2].seqs[0].block_ids == [0, 1, 2]
    collect(results, step(scheduler, runner))  # b recomputes prompt + its first output
    recompute = runner.steps[3].seqs[0]
    assert (recompute.start_pos, recompute.token_ids) == (0, [*b_prompt, 28])
    assert recompute.block_ids == [3, 0, 1]
    assert recompute.sample.output_index == 1
    # its generated token stays a generated token's row (step_inputs.tile_rows)
    assert recompute.prompt_len == len(b_prompt) and runner.steps[1].seqs[0].prompt_len == 7
    run(scheduler, runner, {}, results)
    assert results["a"].tokens == {0: [7, 8, 9]}
    assert results["b"].tokens == {0: [28, 29]}
    assert scheduler.counters.num_prefill_tokens == 7 + 8 + 9


def test_an_older_decode_preempts_the_newest_which_requeues_first() -> None:
    scheduler, runner = make_scheduler(num_blocks=4)
    scheduler.add_request(EngineRequest("a", list(range(8)), params(max_tokens=2)))
    scheduler.add_request(EngineRequest("b", list(range(7)), params(max_tokens=2)))
    scheduler.add_request(EngineRequest("c", [1, 2], params(max_tokens=1)))
    step(scheduler, runner)  # a: [0, 1]; b: [2, 3]; c waits for a block
    step(scheduler, runner)  # a's decode at 8 needs a block: b, the newest, gives its own
    assert [(s.seq_id, s.block_ids) for s in runner.steps[1].seqs] == [(0, [0, 1, 2])]
    assert scheduler.counters.num_preemptions == 1
    step(scheduler, runner)  # a finished; b (requeued at the front) is admitted before c
    assert [(s.seq_id, s.start_pos, s.num_tokens) for s in runner.steps[2].seqs] == [
        (1, 0, 8),
        (2, 0, 2),
    ]
    run(scheduler, runner, {})


def test_a_preempted_sequence_is_not_readmitted_in_the_same_step() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    scheduler.add_request(EngineRequest("a", list(range(4)), params(max_tokens=3)))
    scheduler.add_request(EngineRequest("b", list(range(12)), params(max_tokens=1)))
    step(scheduler, runner)  # a: [0]; b's first chunk of 4: [1]
    step(scheduler, runner)  # a takes block 2; b's next chunk needs 2 blocks, 1 is free
    assert [s.seq_id for s in runner.steps[1].seqs] == [0]  # b would fit again, but waits
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    run(scheduler, runner, {})


def test_preemption_keeps_outputs_identical_to_an_unconstrained_run() -> None:
    arrivals = {
        0: [
            EngineRequest(f"r{i}", list(range(i, i + 5 + i)), params(max_tokens=12, seed=i))
            for i in range(4)
        ]
    }
    small, small_runner = make_scheduler(num_blocks=7)
    constrained = run(small, small_runner, arrivals)
    big, big_runner = make_scheduler()
    unconstrained = run(big, big_runner, arrivals)
    assert small.counters.num_preemptions > 0
    assert big.counters.num_preemptions == 0
    assert constrained == unconstrained
    assert small.counters.num_prefill_tokens > big.counters.num_prefill_tokens


def test_a_choice_that_outgrows_the_pool_ends_with_length() -> None:
    scheduler, runner = make_scheduler(num_blocks=2)
    scheduler.add_request(EngineRequest("r", list(range(6)), params(max_tokens=10)))
    results = run(scheduler, runner, {})
    assert results["r"].tokens == {0: [6, 7, 8]}  # position 8 would need a third block
    assert results["r"].reasons == {0: FinishReason.LENGTH}
    assert scheduler.counters.num_preemptions == 1


def test_a_prompt_that_can_never_fit_fails_with_an_error() -> None:
    scheduler, runner = make_scheduler(num_blocks=2)
    scheduler.add_request(EngineRequest("big", list(range(9)), params()))
    scheduler.add_request(EngineRequest("ok", [1, 2], params(max_tokens=1)))
    out = scheduler.schedule()
    assert [s.seq_id for s in out.seqs] == [1]
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert outputs[0] == RequestOutput(
        request_id="big",
        outputs=[CompletionOutput(index=0, new_token_ids=[], finish_reason=FinishReason.ERROR)],
        finished=True,
        num_prompt_tokens=9,
        error="the request needs 3 KV blocks for its 9 tokens but the pool has 2",
    )
    assert outputs[1].request_id == "ok" and outputs[1].finished
    assert not scheduler.has_unfinished_requests()


def test_more_choices_than_max_num_seqs_fail_with_an_error() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=2)
    scheduler.add_request(EngineRequest("r", [1], params(n=3)))
    assert scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty
    [output] = scheduler.update_from_output(SchedulerOutput(), ModelRunnerOutput())
    assert output.error == "n=3 exceeds max_num_seqs=2"
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert not scheduler.has_unfinished_requests()


def test_unforked_choices_take_their_seats_before_the_fork() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=4)
    scheduler.add_request(EngineRequest("three", [1, 2], params(n=3, max_tokens=2)))
    scheduler.add_request(EngineRequest("two", [1, 2], params(n=2, max_tokens=1)))
    step(scheduler, runner)
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 1)
    results = run(scheduler, runner, {})
    assert sorted(results["two"].tokens) == [0, 1]


# -- n choices ---------------------------------------------------------------------------------
def test_n4_forks_shares_full_blocks_and_copies_the_partial_one() -> None:
    scheduler, runner = make_scheduler()
    prompt = list(range(10))  # blocks 0, 1 full; block 2 holds 2 tokens
    scheduler.add_request(EngineRequest("r", prompt, params(n=4, seed=7, max_tokens=3)))
    seeds = [derive_seed(7, i) for i in range(4)]
    results: dict[str, Collected] = {}
    [first] = step(scheduler, runner)
    collect(results, [first])
    assert runner.steps[0].seqs[0].sample.seeds == seeds
    assert [(c.index, c.new_token_ids) for c in first.outputs] == [
        (i, [next_token(prompt, seed, 0)]) for i, seed in enumerate(seeds)
    ]
    pool = scheduler.kv_cache_manager.pool
    assert [pool.refcount(b) for b in (0, 1, 2)] == [4, 4, 4]
    assert [s.block_ids for s in scheduler.live_sequences()] == [[0, 1, 2]] * 4
    assert [s.seed for s in scheduler.live_sequences()] == seeds

    collect(results, step(scheduler, runner))
    out = runner.steps[1]
    assert out.block_copies == [BlockCopy(2, 3), BlockCopy(2, 4), BlockCopy(2, 5)]
    assert [s.block_ids for s in out.seqs] == [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert [s.sample.seeds for s in out.seqs] == [[seed] for seed in seeds]
    assert [pool.refcount(b) for b in range(6)] == [4, 4, 1, 1, 1, 1]
    assert scheduler.kv_cache_manager.num_cow_copies == 3

    run(scheduler, runner, {}, results)
    assert results["r"].tokens == {i: expected_outputs(prompt, s, 3) for i, s in enumerate(seeds)}
    assert scheduler.counters.num_generation_tokens == 12


def test_forked_choices_decode_next_to_their_parent() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("r", [1, 2, 3], params(n=2)))
    scheduler.add_request(EngineRequest("x", [4, 5, 6], params()))
    step(scheduler, runner)
    step(scheduler, runner)
    # Seq 2 is r's second choice: as old as its parent, so ahead of x (seq 1).
    assert [s.seq_id for s in runner.steps[1].seqs] == [0, 2, 1]
    assert scheduler.get_seq(2).choice_index == 1


def test_abort_one_choice_with_a_reason_keeps_the_others() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("r", [1, 2, 3], params(n=3, max_tokens=3)))
    with pytest.raises(ChoiceNotForked, match="choice 1 of request r has not forked yet"):
        scheduler.abort_request("r", choice_index=1, reason=FinishReason.STOP)
    step(scheduler, runner)
    output = scheduler.abort_request("r", choice_index=1, reason=FinishReason.STOP)
    assert output.outputs == [CompletionOutput(1, [], finish_reason=FinishReason.STOP)]
    assert not output.finished
    assert scheduler.abort_request("r", choice_index=1) is None
    results = run(scheduler, runner, {})
    assert {i: len(t) for i, t in results["r"].tokens.items()} == {0: 2, 2: 2}  # after abort
    assert results["r"].reasons == {0: FinishReason.LENGTH, 2: FinishReason.LENGTH}


# -- abort and faults --------------------------------------------------------------------------
def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("num_steps", [0, 1, 3], ids=["waiting", "mid-prefill", "mid-decode"])
def test_abort_frees_everything(num_steps: int) -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(EngineRequest("r", list(range(6)), params(n=2, max_tokens=8)))
    for _ in range(num_steps):
        step(scheduler, runner)
    output = scheduler.abort_request("r")
    assert output.finished and output.request_id == "r"
    assert [(c.index, c.new_token_ids, c.finish_reason) for c in output.outputs] == [
        (0, [], FinishReason.ABORT),
        (1, [], FinishReason.ABORT),
    ]
    assert scheduler.abort_request("r") is None
    assert scheduler.abort_request("unknown") is None
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update_drops_the_sample() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("a", [1, 2], params()))
    scheduler.add_request(EngineRequest("b", [1, 2], params()))
    out = scheduler.schedule()
    runner_out = runner.execute(out)
    scheduler.abort_request("a")
    outputs = scheduler.update_from_output(out, runner_out)
    assert [o.request_id for o in outputs] == ["b"]
    scheduler.check_integrity()


def test_fail_seqs_fails_only_their_requests() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("forked", [1, 2, 3], params(n=3, max_tokens=5)))
    scheduler.add_request(EngineRequest("other", [9], params(max_tokens=5)))
    step(scheduler, runner)
    child = scheduler.live_sequences()[-1]
    assert (child.request_id, child.choice_index) == ("forked", 2)
    [output] = scheduler.fail_seqs([child.seq_id, child.seq_id, 999], "boom")
    assert (output.request_id, output.finished, output.error) == ("forked", True, "boom")
    assert [(c.index, c.finish_reason) for c in output.outputs] == [
        (i, FinishReason.ERROR) for i in range(3)
    ]
    scheduler.check_integrity()
    results = run(scheduler, runner, {})
    assert results["other"].tokens == {0: [11, 12, 13, 14]}  # 10 came in the first step
    assert results["other"].reasons == {0: FinishReason.LENGTH}


# -- stop checks -------------------------------------------------------------------------------
STOP_CASES = [
    # (sampling overrides, eos ids, max_model_len, outputs, reason, stop token id)
    (dict(max_tokens=3), (), 128, [11, 12, 13], FinishReason.LENGTH, None),
    (dict(ignore_eos=False), (13,), 128, [11, 12, 13], FinishReason.STOP, 13),
    (
        dict(ignore_eos=True, max_tokens=5),
        (13,),
        128,
        [11, 12, 13, 14, 15],
        FinishReason.LENGTH,
        None,
    ),
    (dict(ignore_eos=False, max_tokens=3), (13,), 128, [11, 12, 13], FinishReason.STOP, 13),
    (dict(ignore_eos=False, min_tokens=2), (12, 14), 128, [11, 12, 13, 14], FinishReason.STOP, 14),
    (dict(stop_token_ids=(13,), min_tokens=2), (), 128, [11, 12, 13], FinishReason.STOP, 13),
    (dict(stop_token_ids=(12, 14), min_tokens=2), (), 128, [11, 12, 13, 14], FinishReason.STOP, 14),
    (dict(stop_token_ids=(11,), ignore_eos=True), (), 128, [11], FinishReason.STOP, 11),
    (dict(max_tokens=10), (), 5, [11, 12, 13], FinishReason.LENGTH, None),
]


@pytest.mark.parametrize(
    ("overrides", "eos", "max_model_len", "tokens", "reason", "stop_id"), STOP_CASES
)
def test_stop_checks(overrides, eos, max_model_len, tokens, reason, stop_id) -> None:
    scheduler, runner = make_scheduler(max_model_len=max_model_len, eos_token_ids=eos)
    settings = dict(max_tokens=6)
    settings.update(overrides)
    scheduler.add_request(EngineRequest("r", [9, 10], params(**settings)))
    result = run(scheduler, runner, {})["r"]
    assert (result.tokens, result.reasons, result.stop_token_ids) == (
        {0: tokens},
        {0: reason},
        {0: stop_id},
    )


# -- outputs -----------------------------------------------------------------------------------
def test_outputs_are_deltas_with_logprobs_when_asked() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(EngineRequest("r", [4, 5], params(max_tokens=2, logprobs=1)))
    scheduler.add_request(EngineRequest("plain", [4], params(max_tokens=1)))
    first = step(scheduler, runner)
    assert first == [
        RequestOutput(
            "r",
            [CompletionOutput(0, [6], [TokenLogprob(6, -0.5, [(6, -0.5)])])],
            finished=False,
            num_prompt_tokens=2,
        ),
        RequestOutput(
            "plain",
            [CompletionOutput(0, [5], None, FinishReason.LENGTH)],
            finished=True,
            num_prompt_tokens=1,
        ),
    ]
    [second] = step(scheduler, runner)
    assert second.outputs[0].new_token_ids == [7] and second.finished
    c = scheduler.counters
    assert (c.num_prompt_tokens, c.num_prefill_tokens, c.num_generation_tokens) == (3, 3, 3)


def test_a_request_without_seed_gets_a_random_one() -> None:
    scheduler, runner = make_scheduler()
    for name in ("x", "y"):
        scheduler.add_request(EngineRequest(name, [1], SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    seeds = [s.sample.seeds[0] for s in out.seqs]
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert seeds[0] != seeds[1]
    scheduler.update_from_output(out, runner.execute(out))
    assert_all_free(scheduler)


def test_stats_reports_queues_blocks_and_counters() -> None:
    scheduler, runner = make_scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(EngineRequest("a", list(range(5)), params()))
    scheduler.add_request(EngineRequest("b", [1], params()))
    step(scheduler, runner)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_private_blocks) == (8, 6, 2)
    assert stats.kv_fragmentation_ratio == 3 / 8  # 5 tokens in 2 blocks of 4 slots
    assert stats.kv_usage_watermark == 2 / 8
    assert (stats.num_prompt_tokens, stats.num_prefill_tokens, stats.num_leaked_blocks) == (6, 5, 0)
