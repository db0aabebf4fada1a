"""Speculative decoding by n-gram prompt lookup on the tiny Llama: the same token ids as
decoding without it (greedy: HF's; seeded sampling: the engine's own non-speculative run),
with the prefix cache on and off, under preemption, and no block leaked."""

from __future__ import annotations

import pytest

from engine.core.batch import SampledToken
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.core.spec_ngram import NgramProposer, num_accepted
from tests.engine.engine_helpers import make_engine, random_prompts, run_checked
from tests.oracle import hf_greedy


def repetitive_prompts(num: int, seed: int) -> list[list[int]]:
    """A random phrase repeated: the greedy continuation of the tiny model tends to loop
    over context it has seen, so drafts get accepted (and rejected) often."""
    return [phrase * 4 for phrase in random_prompts(num, seed, min_len=6, max_len=12)]


def spec_engine(model_dir: str, **overrides):
    settings = dict(speculative_ngram_tokens=4, speculative_ngram_min=1, speculative_ngram_max=3)
    return make_engine(model_dir, **{**settings, **overrides})


def test_proposer_takes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6, 7], 10) == [8, 9, 5]
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2], 10) == [4, 1, 2]  # the latest match wins
    assert proposer.propose([1, 2, 3, 4], 10) == []  # no earlier occurrence of any suffix
    assert proposer.propose([5, 6, 7, 8, 5, 6], 1) == [7]  # capped by the caller
    assert proposer.propose([9, 9], 5) == [9]  # the draft may run up to the end
    # A token id whose bytes straddle two ids must not match (byte search is aligned).
    assert proposer.propose([0x0100, 0x01000000, 7, 1], 4) == []


def test_num_accepted_is_the_agreeing_prefix():
    chosen = [SampledToken(t) for t in (4, 5, 9, 1)]
    assert num_accepted([4, 5, 6], chosen) == 2
    assert num_accepted([7, 5, 6], chosen) == 0
    assert num_accepted([4, 5, 9], chosen) == 3


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_greedy_speculation_equals_hf(tiny_model_dir, hf_model, enable_prefix_cache):
    engine = spec_engine(tiny_model_dir, enable_prefix_cache=enable_prefix_cache)
    prompts = repetitive_prompts(6, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {0: [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    tokens = run_checked(engine, requests)
    stats = engine.stats()
    assert stats.num_spec_draft_tokens > 0
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 24), f"prompt {i}"


def test_seeded_sampling_with_speculation_equals_without(tiny_model_dir):
    prompts = repetitive_prompts(4, seed=22)
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=20, seed=3, ignore_eos=True, n=2)
    requests = {0: [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    plain = run_checked(make_engine(tiny_model_dir), requests)
    engine = spec_engine(tiny_model_dir)
    assert run_checked(engine, requests) == plain
    assert engine.stats().num_spec_accepted_tokens > 0


def test_preemption_during_speculation_keeps_outputs_and_blocks(tiny_model_dir, hf_model):
    engine = spec_engine(tiny_model_dir, num_kv_blocks=12)
    prompts = repetitive_prompts(8, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    requests = {0: [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    tokens = run_checked(engine, requests)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_accepted_tokens > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 40), f"prompt {i}"


def test_stops_inside_a_kept_draft_end_there(tiny_model_dir, hf_model):
    prompt = repetitive_prompts(1, seed=24)[0]
    expected = hf_greedy(hf_model, prompt, 30)
    stop_token = expected[9]
    first_stop = expected.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_token,))
    for max_tokens in (30, 7):  # a stop token, then max_tokens, inside drafts
        engine = spec_engine(tiny_model_dir)
        limited = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        got = run_checked(engine, {0: [EngineRequest("r", prompt, limited)]})["r"][0]
        assert got == expected[: min(first_stop + 1, max_tokens)]


def test_async_scheduling_looks_ahead_only_where_no_step_would_draft(tiny_model_dir, hf_model):
    """speculative_max_decodes 1: a batch of five decodes without drafts, on lookahead steps,
    until one sequence is left, which drafts and is never looked ahead; HF's tokens."""
    engine = spec_engine(tiny_model_dir, speculative_max_decodes=1, async_scheduling="on")
    prompts = repetitive_prompts(5, seed=22)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(5)
    ]
    requests = {0: [EngineRequest(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]}
    tokens = run_checked(engine, requests)
    stats = engine.stats()
    assert stats.num_lookahead_steps > 0 and stats.num_spec_draft_tokens > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 8 + 6 * i), f"prompt {i}"
