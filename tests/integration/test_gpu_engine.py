"""The engine on a CUDA GPU: bf16 + Triton attention + CUDA graphs, on the embedded SmolLM2.

- greedy output vs HF `generate` in bf16 on the same GPU. Two bf16 implementations round
  differently (fused projections, other attention kernels), so a prompt may diverge where
  HF's top two logits nearly tie; a divergence anywhere else fails, and so do many of them;
- CUDA graphs vs eager (enforce_eager) on the same engine config: token for token when every
  decode batch is a captured size (same kernels, same shapes), near ties only where padding
  changes the matmul shapes;
- the KV pool sized from free memory after the warm-up pass.

Skipped without CUDA (the gpu marker) or compiled Triton (tests/conftest.py).
scripts/gpu_check.sh runs it (pytest -m gpu).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]

MAX_NUM_SEQS = 16  # captured sizes 1, 2, 4, 8, 16
HF_TOKENS = 16
HF_LOGIT_TIE = 0.5  # bf16 logits near 20 are spaced 0.125 apart
LOGPROB_TIE = 0.15
CUDA = torch.device("cuda")


def engine_config(**overrides) -> EngineConfig:
    # no prefix cache: both engines must compute every prompt the same way, from scratch
    settings = {"device": "cuda", "max_num_seqs": MAX_NUM_SEQS, "num_kv_blocks": 1024}
    return EngineConfig(**{**settings, "enable_prefix_cache": False, **overrides})


@pytest.fixture(scope="module")
def graph_engine() -> LLMEngine:
    return LLMEngine(engine_config())


@pytest.fixture(scope="module")
def eager_engine() -> LLMEngine:
    return LLMEngine(engine_config(enforce_eager=True))


@pytest.fixture(scope="module")
def hf_reference(model_dir, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: HF bf16 greedy tokens and the raw logits of each step [HF_TOKENS, V]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(CUDA).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device=CUDA),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
                max_new_tokens=HF_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            logits = torch.stack(out.logits)[:, 0].float().cpu()  # [N, V]
            results.append((out.sequences[0, len(prompt) :].tolist(), logits))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str
) -> list[tuple[list[int], list[TokenLogprob]]]:
    """Prompt i arrives at step i: steps mix prefills with decodes, then decode batches
    shrink as requests finish one by one (7 -> padded to 8, ..., 3 -> 4, 1)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[TokenLogprob]] = [[] for _ in prompts]
    step = 0
    while step < len(prompts) or engine.has_unfinished_requests():
        if step < len(prompts):
            engine.add_request(EngineRequest(f"{tag}-{step}", prompts[step], params))
        for output in engine.step():
            assert output.error is None, output.error
            i = int(output.request_id.rsplit("-", 1)[1])
            tokens[i] += output.outputs[0].new_token_ids
            logprobs[i] += output.outputs[0].new_logprobs or []
        step += 1
    return list(zip(tokens, logprobs, strict=True))


def test_kv_pool_is_sized_from_free_memory_after_warm_up(caplog) -> None:
    caplog.set_level(logging.INFO)
    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests left cached would read as in use
    free, total = torch.cuda.mem_get_info()
    runner = ModelRunner(engine_config(num_kv_blocks=None, gpu_memory_utilization=0.3))
    try:
        pool_bytes = runner.num_kv_blocks * runner.bytes_per_block
        ceiling = 0.3 * total - (total - free)  # before weights, activations and graphs
        assert ceiling - (4 << 30) < pool_bytes <= ceiling
        assert runner.kv_caches[0][0].dtype == torch.bfloat16
        assert "gpu_memory_utilization 0.30 leaves" in caplog.text
        assert "CUDA graphs: " in caplog.text and "KV cache: " in caplog.text
    finally:
        del runner
        gc.collect()
        torch.cuda.empty_cache()


def test_engine_runs_bf16_triton_with_captured_graphs(graph_engine, eager_engine) -> None:
    runner = graph_engine.runner
    assert (runner.dtype, runner.attn_backend.name) == (torch.bfloat16, "triton")
    assert runner.graph_runner.sizes == [1, 2, 4, 8, 16]
    assert {size for size, _ in runner.graph_runner.graphs} == {1, 2, 4, 8, 16}
    assert eager_engine.runner.graph_runner is None


def test_greedy_bf16_matches_hf_generate(graph_engine, prompts, hf_reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=HF_TOKENS, ignore_eos=True)
    replays_before = graph_engine.runner.graph_runner.num_replays
    results = graph_engine.generate(prompts, params)
    assert graph_engine.runner.graph_runner.num_replays >= replays_before + HF_TOKENS - 1
    diverged = []
    for i, (result, (expected, logits)) in enumerate(zip(results, hf_reference, strict=True)):
        ours = result.token_ids[0]
        assert len(ours) == len(expected) == HF_TOKENS
        at = first_difference(ours, expected)
        if at is None:
            continue
        gap = (logits[at, expected[at]] - logits[at, ours[at]]).item()
        assert gap <= HF_LOGIT_TIE, f"prompt {i} diverges at token {at}: HF logit gap {gap:.3f}"
        diverged.append(i)
    assert len(diverged) <= len(prompts) // 4, f"prompts {diverged} diverge from HF"


def test_graphs_equal_eager_when_batches_are_captured_sizes(
    graph_engine, eager_engine, prompts
) -> None:
    assert len(prompts) == MAX_NUM_SEQS  # one prefill step, then decode steps of exactly 16
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    replays_before = graph_engine.runner.graph_runner.num_replays
    with_graphs = [r.token_ids[0] for r in graph_engine.generate(prompts, params)]
    assert graph_engine.runner.graph_runner.num_replays == replays_before + 23
    eager = [r.token_ids[0] for r in eager_engine.generate(prompts, params)]
    assert with_graphs == eager


def test_graphs_match_eager_with_padding_and_mixed_steps(
    graph_engine, eager_engine, prompts
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    replays_before = graph_engine.runner.graph_runner.num_replays
    with_graphs = run_staggered(graph_engine, prompts[:7], params, "padded-graph")
    assert graph_engine.runner.graph_runner.num_replays > replays_before
    eager = run_staggered(eager_engine, prompts[:7], params, "padded-eager")
    diverged = []
    for i, ((ours, _), (expected, expected_logprobs)) in enumerate(
        zip(with_graphs, eager, strict=True)
    ):
        at = first_difference(ours, expected)
        if at is None:
            continue
        top = dict(expected_logprobs[at].top_logprobs)  # eager's two best at the divergence
        assert ours[at] in top, f"prompt {i}: token {at} is not eager's first or second choice"
        gap = top[expected[at]] - top[ours[at]]
        assert gap <= LOGPROB_TIE, f"prompt {i} diverges at token {at}: logprob gap {gap:.3f}"
        diverged.append(i)
    assert len(diverged) <= 1, f"prompts {diverged} diverge between graphs and eager"
