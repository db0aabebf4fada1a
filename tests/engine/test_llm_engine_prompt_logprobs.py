"""Prompt logprobs (echo with logprobs) and max_tokens 0 on the tiny Llama, against HF.

The oracle: HF's log-softmax of its own logits at every prompt position but the last, the
logprob of the next prompt token and the top alternatives. Scoring must not depend on the
prefix cache (cached positions have no logits, so a scoring request reuses nothing but still
leaves its blocks in the cache), on chunking, or on preemption, and must leak no block.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.protocol import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.engine_helpers import assert_all_blocks_free, make_engine, random_prompts
from tests.oracle import hf_greedy

NUM_TOP = 3
ATOL = 1e-4  # fp32: the same weights, a different matmul order


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: row i is HF's log-softmax at position i (it predicts prompt token i + 1)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_hf(scored: list[TokenLogprob], hf_model, prompt: list[int]) -> None:
    expected = hf_prompt_logprobs(hf_model, prompt)
    assert [s.token_id for s in scored] == prompt[1:]
    got = torch.tensor([s.logprob for s in scored])
    want = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    top = expected.topk(NUM_TOP, dim=-1)
    for i, s in enumerate(scored):
        assert [t for t, _ in s.top_logprobs] == top.indices[i].tolist(), f"position {i}"
        values = torch.tensor([v for _, v in s.top_logprobs])
        torch.testing.assert_close(values, top.values[i], atol=ATOL, rtol=0)


def run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    """Step to the end, checking integrity after every step; every request's outputs."""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            outputs[output.request_id].append(output)
        engine.scheduler.check_integrity()
    assert engine.stats().num_leaked_blocks == 0
    return outputs


def scored_once(outputs: list[RequestOutput]) -> list[TokenLogprob]:
    """The prompt logprobs, which exactly one delta carries."""
    carried = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(carried) == 1, f"{len(carried)} deltas carried prompt logprobs"
    return carried[0]


def score(max_tokens: int = 0, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=NUM_TOP, **extra
    )


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(1, seed=11, min_len=40, max_len=40)[0]
    outputs = run(engine, [EngineRequest("s", prompt, score())])["s"]
    assert_matches_hf(scored_once(outputs), hf_model, prompt)
    assert [c.new_token_ids for o in outputs for c in o.outputs] == [[]]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason is FinishReason.LENGTH
    assert engine.stats().num_generation_tokens == 0
    assert_all_blocks_free(engine)


def test_max_tokens_0_without_logprobs_caches_the_prompt(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(1, seed=12, min_len=40, max_len=40)[0]
    warm = SamplingParams(temperature=0.0, max_tokens=0)
    outputs = run(engine, [EngineRequest("w", prompt, warm)])["w"]
    assert [o.prompt_logprobs for o in outputs] == [None]
    assert outputs[0].outputs[0].new_token_ids == []
    probe = run(engine, [EngineRequest("p", prompt, SamplingParams(max_tokens=1))])["p"]
    assert probe[-1].num_cached_tokens == 32  # its two full blocks (of 16) were cached


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_a_cached_prompt_is_recomputed_for_scoring_and_cached_again(
    tiny_model_dir, hf_model, enable_prefix_cache
):
    engine = make_engine(tiny_model_dir, enable_prefix_cache=enable_prefix_cache)
    prompt = random_prompts(1, seed=13, min_len=50, max_len=50)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = run(engine, [EngineRequest("a", prompt, greedy)])["a"]
    assert first[-1].num_cached_tokens == 0
    computed_before = engine.stats().num_prefill_tokens
    outputs = run(engine, [EngineRequest("s", prompt, score(max_tokens=4))])["s"]
    assert outputs[-1].num_cached_tokens == 0
    assert engine.stats().num_prefill_tokens - computed_before == len(prompt)
    assert_matches_hf(scored_once(outputs), hf_model, prompt)
    tokens = [t for o in outputs for c in o.outputs for t in c.new_token_ids]
    assert tokens == hf_greedy(hf_model, prompt, 4)
    again = run(engine, [EngineRequest("b", prompt, greedy)])["b"]
    assert again[-1].num_cached_tokens == (48 if enable_prefix_cache else 0)
    assert_all_blocks_free(engine)


def test_chunked_prefill_scores_every_position_once(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    prompts = random_prompts(3, seed=14, min_len=35, max_len=70)
    requests = [EngineRequest(f"s{i}", p, score(max_tokens=2)) for i, p in enumerate(prompts)]
    outputs = run(engine, requests)
    for i, prompt in enumerate(prompts):
        assert_matches_hf(scored_once(outputs[f"s{i}"]), hf_model, prompt)
    assert_all_blocks_free(engine)


def test_preemption_while_scoring_keeps_every_logprob_once(tiny_model_dir, hf_model):
    # 6 prompts of 40-60 tokens + 16 outputs need ~30 blocks of 16; the pool has 10.
    engine = make_engine(tiny_model_dir, num_kv_blocks=10, max_num_batched_tokens=32)
    prompts = random_prompts(6, seed=15, min_len=40, max_len=60)
    requests = [EngineRequest(f"s{i}", p, score(max_tokens=16)) for i, p in enumerate(prompts)]
    outputs = run(engine, requests)
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_matches_hf(scored_once(outputs[f"s{i}"]), hf_model, prompt)
        tokens = [t for o in outputs[f"s{i}"] for c in o.outputs for t in c.new_token_ids]
        assert tokens == hf_greedy(hf_model, prompt, 16), f"prompt {i}"
    assert_all_blocks_free(engine)


def test_n_choices_share_one_scored_prompt(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(1, seed=16, min_len=30, max_len=30)[0]
    params = SamplingParams(
        n=3, max_tokens=5, seed=7, ignore_eos=True, prompt_logprobs=NUM_TOP, logprobs=1
    )
    outputs = run(engine, [EngineRequest("n", prompt, params)])["n"]
    assert_matches_hf(scored_once(outputs), hf_model, prompt)
    first = next(o for o in outputs if o.prompt_logprobs is not None)
    assert sorted(c.index for c in first.outputs) == [0, 1, 2]  # with the first tokens
    assert_all_blocks_free(engine)


def test_a_one_token_prompt_has_nothing_to_score(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    outputs = run(engine, [EngineRequest("one", [5], score(max_tokens=1))])["one"]
    assert scored_once(outputs) == []


def test_bad_values_name_their_field():
    from engine.core.errors import ParamError

    for kwargs, param in (
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ):
        with pytest.raises(ParamError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param
