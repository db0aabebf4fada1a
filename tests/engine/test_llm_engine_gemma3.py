"""LLMEngine on a tiny random Gemma 3 whose local layers see 16 positions (one block): greedy
outputs equal HF generate, and a prefix-cache hit on a prompt longer than the window gives
what a miss gives, whether the match ends on a block edge or inside a block (copied)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from tests.engine.engine_helpers import (
    GREEDY,
    VOCAB,
    assert_all_blocks_free,
    make_engine,
    random_prompts,
    run_checked,
)
from tests.engine.test_llm_engine_prefix import one_after_another, tokens
from tests.oracle import hf_greedy
from tests.tiny_models import TINY_MAX_LEN

WINDOW = 16  # the engine's block size: windows start and end on block edges and inside them


@pytest.fixture(scope="module")
def gemma_dir(make_tiny_model) -> str:
    return str(make_tiny_model("gemma3", sliding_window=WINDOW))


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def test_the_context_runs_past_the_window(gemma_dir):
    engine = make_engine(gemma_dir)
    assert engine.runner.max_model_len == TINY_MAX_LEN > WINDOW


def test_prompts_and_answers_past_the_window_match_hf(gemma_dir, hf_gemma):
    engine = make_engine(gemma_dir, max_num_batched_tokens=24)  # long prompts come in chunks
    prompts = random_prompts(6, seed=11, min_len=5, max_len=70)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    requests = {2 * i: [EngineRequest(f"r{i}", p, params)] for i, p in enumerate(prompts)}
    outputs = run_checked(engine, requests)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][0] == hf_greedy(hf_gemma, prompt, 20), f"prompt {i}"


BASE = tokens(60, seed=21)


@pytest.mark.parametrize(
    ("second", "num_cached"),
    [
        (BASE, 59),  # all but the last token
        ([*BASE[:48], *tokens(9, seed=22)], 48),  # the match ends on a block edge
        ([*BASE[:37], (BASE[37] + 1) % VOCAB, *BASE[38:]], 37),  # ... inside a block: copied
    ],
    ids=["same", "block-edge", "mid-block"],
)
def test_a_hit_longer_than_the_window_gives_what_a_miss_gives(
    gemma_dir, hf_gemma, second, num_cached
):
    engine = make_engine(gemma_dir)
    results = one_after_another(engine, [BASE, second])
    assert [r["cached"] for r in results] == [0, num_cached]
    assert num_cached > WINDOW
    fresh = make_engine(gemma_dir, enable_prefix_cache=False).generate([second], GREEDY)
    assert results[1]["tokens"] == fresh[0].token_ids[0]
    assert results[1]["tokens"] == hf_greedy(hf_gemma, second, GREEDY.max_tokens)
    if num_cached % 16:
        assert engine.stats().num_cow_copies > 0  # the partial block was copied, not written
    assert_all_blocks_free(engine)
