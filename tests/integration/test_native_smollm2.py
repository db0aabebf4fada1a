"""quantization native on the embedded SmolLM2 (what config/cpu.yaml serves): its GGUF blocks as
stored. The blocks dequantize to exactly the exact mode's weights; the model tracks the exact
mode teacher-forced on benchmarks/quality_text.txt; its weights stay near the file's size; and
a seeded request's tokens are the same alone and in a crowd of 8; greedy tokens taken from the
Q8_0 head's few candidate panels (GreedyHead) are its full logits' argmax. Also q8_0 (Q8_0 blocks
made at load) on the same text."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.cpu.block_linear import BlockEmbedding, BlockLinear, GreedyHead
from engine.runtime.cpu.capabilities import cpu_capabilities
from engine.runtime.cpu.native import load_library
from engine.runtime.loader import iter_weights, kvshare_cache_dir, load_model, resolve_model_source
from engine.runtime.model_runner import ModelRunner
from engine.runtime.quant_quality import TextScore, compare, score_text

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler"),
]

CPU = torch.device("cpu")
TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_text.txt"
NUM_TOKENS = 600
# mode -> (min top-1 agreement, max perplexity ratio) on 600 tokens; the goals on the whole
# text (benchmarks/quality.py) are >= 0.999 and <= 1.001 for native.
BOUNDS = {"native": (0.995, 1.002), "q8_0": (0.97, 1.03)}


# Whether SmolLM2's prompt tokens (Q4_1 and Q8_0 panels) take another path than its generated
# ones here: the AMX tiles, or the prefill GEMM below AVX-512 (kvshare_prompt_path).
PROMPTS_APART = cpu_capabilities().prompt_rows and (
    cpu_capabilities().amx or cpu_capabilities().isa != "avx512"
)
# The text read as a prompt (on the kernels' prompt path, step_inputs.tile_rows), and where
# that path is another, also as generated tokens, on the FMAs.
READINGS = ["prompt"] + (["generated"] if PROMPTS_APART else [])


def score(mode: str, token_ids: list[int], reading: str = "prompt") -> TextScore:
    config = EngineConfig(
        dtype="float32", device="cpu", quantization=mode, num_kv_blocks=64, num_threads=2
    )
    runner = ModelRunner(config)
    return score_text(runner, token_ids, chunk_tokens=128, as_prompt=reading == "prompt")


@pytest.fixture(scope="module")
def token_ids(model_dir) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT.read_text())["input_ids"]
    return ids[:NUM_TOKENS]


@pytest.fixture(scope="module")
def native_model():
    config = EngineConfig(dtype="float32", device="cpu", quantization="native")
    return load_model(config, CPU, torch.float32).model


@pytest.mark.parametrize("reading", READINGS)
@pytest.mark.parametrize("mode", sorted(BOUNDS))
def test_block_modes_track_the_exact_model(mode: str, reading: str, token_ids) -> None:
    min_agreement, max_ratio = BOUNDS[mode]
    agreement = compare(score("none", token_ids), score(mode, token_ids, reading))
    assert agreement.num_positions == NUM_TOKENS - 1
    assert agreement.top1_agreement >= min_agreement, agreement
    assert agreement.perplexity_ratio <= max_ratio, agreement


def test_every_block_weight_is_the_exact_modes_weight(native_model) -> None:
    """The blocks as stored, dequantized by gguf-py, equal the fp32 weights the exact mode loads
    (transformers' conversion of the same file), bit for bit: q and k rows included, whose
    order llama.cpp changes and the loader restores."""
    source = resolve_model_source(EngineConfig())
    exact = dict(iter_weights(source.model_dir))
    checked = 0
    for name, module in native_model.named_modules():
        if not isinstance(module, BlockLinear | BlockEmbedding):
            continue
        if name == "lm_head":  # tied: the embedding's blocks
            expected = exact["model.embed_tokens.weight"]
        elif name.endswith("qkv_proj"):
            prefix = name.removesuffix(".qkv_proj")
            parts = [f"{prefix}.{p}_proj.weight" for p in "qkv"]
            expected = torch.cat([exact[p] for p in parts])
        elif name.endswith("gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            expected = torch.cat([exact[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up")])
        else:
            expected = exact[f"{name}.weight"]
        assert torch.equal(module.block_weight.dequantize(), expected), name
        checked += 1
    num_layers = native_model.spec.num_layers
    assert checked == 4 * num_layers + 2, checked  # qkv, o, gate_up, down; embedding and head


def test_resident_weights_stay_near_the_gguf_files_size(native_model) -> None:
    """Goal: resident weight bytes at most 1.25x the GGUF file (blocks shared by the tied
    embedding and head counted once; norms and the rope tables included)."""
    gguf_bytes = resolve_model_source(EngineConfig()).gguf_path.stat().st_size
    blocks = {
        m.block_weight.data.data_ptr(): m.block_weight.data.numel()
        for m in native_model.modules()
        if isinstance(m, BlockLinear | BlockEmbedding)
    }
    tensors = list(native_model.parameters()) + list(native_model.buffers())
    if native_model.greedy_head is not None:  # the head rows' norms
        tensors.append(native_model.greedy_head.norms)
    dense = sum(t.numel() * t.element_size() for t in tensors)
    assert sum(blocks.values()) + dense <= 1.25 * gguf_bytes


# Every token on the FMAs, and where their path is another, the prompt tokens on it (AMX tiles or
# the prefill GEMM) with the generated ones on the FMAs (step_inputs.tile_rows).
PANEL_PATHS = ["fmas"] + (["prompts-on-their-path"] if PROMPTS_APART else [])


@pytest.mark.parametrize("path", PANEL_PATHS)
def test_a_seeded_request_is_the_same_alone_and_in_a_crowd_of_8(prompts, path: str) -> None:
    config = EngineConfig(dtype="float32", quantization="native", num_kv_blocks=256, max_num_seqs=8)
    engine = LLMEngine(config)
    assert engine.runner.tile_prompts == cpu_capabilities().prompt_rows
    engine.runner.tile_prompts = path == "prompts-on-their-path"
    check_alone_and_in_a_crowd(engine, prompts)


def check_alone_and_in_a_crowd(engine: LLMEngine, prompts) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids[0]
    others = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=8 + 3 * i, ignore_eos=True)
        for i in range(7)
    ]
    crowd = engine.generate([prompts[0], *prompts[1:8]], [seeded, *others])
    assert crowd[0].token_ids[0] == alone
    assert len(alone) == 24


def greedy_head_of(model) -> GreedyHead:
    """The model's GreedyHead; one made for it where this CPU's build leaves the product without
    (no VNNI: the estimate then runs the plain loops)."""
    if model.greedy_head is not None:
        return model.greedy_head
    return GreedyHead(model.lm_head, load_library(kvshare_cache_dir(EngineConfig()) / "kernels"))


def test_greedy_head_tokens_are_the_argmax_of_the_heads_logits_on_real_hidden_states(
    native_model, token_ids, model_dir
) -> None:
    """The final hidden states of the quality text (HF's exact model), 600 rows at 1, 3 and 8 at
    a time: the greedy head's token is the full head's argmax for every one."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0]
    greedy = greedy_head_of(native_model)
    expected = native_model.lm_head(hidden).argmax(dim=-1)
    for rows in (1, 3, 8):
        found, computed = [], 0
        for i in range(0, len(hidden), rows):
            found.append(greedy(hidden[i : i + rows]))
            computed += greedy.panels_computed
        assert torch.equal(torch.cat(found), expected), rows
        assert computed / len(hidden) < 50  # panels a row, of 3,072: the estimate narrowed it


def test_greedy_requests_are_the_same_with_and_without_the_greedy_head(prompts) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", quantization="native", num_kv_blocks=256, max_num_seqs=8)
    )
    model = engine.runner.model
    head = greedy_head_of(model)
    calls = []

    def counted(hidden: torch.Tensor) -> torch.Tensor | None:
        calls.append(hidden.shape[0])
        return head(hidden)

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    model.greedy_head = counted
    with_head = [out.token_ids[0] for out in engine.generate(prompts[:8], greedy)]
    assert calls and max(calls) == 8  # it answered the steps, the whole batch at once
    model.greedy_head = None
    without = [out.token_ids[0] for out in engine.generate(prompts[:8], greedy)]
    assert with_head == without
    # Rows that ask for logprobs need the logits: the greedy head is never asked for them.
    model.greedy_head, calls[:] = counted, []
    with_logprobs = dataclasses.replace(greedy, logprobs=1)
    scored = engine.generate([prompts[0]], with_logprobs)[0]
    assert calls == [] and scored.token_ids[0] == with_head[0]


def test_async_scheduling_gives_the_same_text_on_the_native_step(prompts) -> None:
    """Lookahead steps (engine/sched/lookahead.py) through the native decode step and the
    greedy head: each row's input token patched in from the step before, the text the
    synchronous steps'."""
    engine = LLMEngine(
        EngineConfig(dtype="float32", quantization="native", num_kv_blocks=256, max_num_seqs=8)
    )
    assert engine.runner.model.native_decode is not None and not engine.async_scheduling
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 2 * i,
                       ignore_eos=True)
        for i in range(8)
    ]  # fmt: skip
    synchronous = [out.token_ids for out in engine.generate(prompts[:8], params)]
    engine.async_scheduling = True
    before = engine.stats().num_lookahead_steps
    assert [out.token_ids for out in engine.generate(prompts[:8], params)] == synchronous
    greedy = [params[i] for i in range(1, 8, 2)]  # all greedy: the greedy head's tokens
    assert [out.token_ids for out in engine.generate(prompts[1:8:2], greedy)] == synchronous[1::2]
    assert engine.stats().num_lookahead_steps - before >= 20
