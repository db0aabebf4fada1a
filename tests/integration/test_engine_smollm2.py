"""The engine on the embedded SmolLM2-135M-Instruct vs HF `generate` on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.oracle import hf_greedy

pytestmark = pytest.mark.integration

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_outputs(model_dir, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=16))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_one_prompt_matches_hf(engine, prompts, hf_outputs):
    assert engine.generate([prompts[0]], GREEDY)[0].token_ids[0] == hf_outputs[0]


def test_sixteen_together_match_hf(engine, prompts, hf_outputs):
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids[0] for r in results] == hf_outputs


def test_sixteen_staggered_match_hf(engine, prompts, hf_outputs):
    tokens: dict[str, list[int]] = {}
    step = 0
    while step < 2 * len(prompts) or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            engine.add_request(EngineRequest(f"s{i}", prompts[i], GREEDY))
            tokens[f"s{i}"] = []
        for output in engine.step():
            tokens[output.request_id].extend(output.outputs[0].new_token_ids)
        step += 1
    assert [tokens[f"s{i}"] for i in range(len(prompts))] == hf_outputs
    # No sequence holds a block: every block is free or held by the prefix tree alone.
    engine.kv_cache_manager.check_integrity([])
    usage = engine.kv_cache_manager.usage
    assert usage.num_private_blocks == usage.num_shared_blocks == 0
