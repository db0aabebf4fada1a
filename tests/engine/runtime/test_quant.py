"""The quantization modes (engine/runtime/cpu/quant.py) against independent references: the
fp64 matmul of the same weights, an fp64 emulation of the int8 arithmetic, HF transformers'
logits, and the scorer of engine/runtime/quant_quality.py against HF's log-softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from engine.audit.auditor import audit_tolerance
from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.runtime.cpu import capabilities
from engine.runtime.cpu.linear import PackedLinear
from engine.runtime.cpu.quant import (
    Fp16Linear,
    Int8Linear,
    can_quantize,
    quantize_model,
    quantize_per_channel,
)
from engine.runtime.loader import load_model
from engine.runtime.model_runner import ModelRunner
from engine.runtime.quant_quality import compare, score_text
from tests.oracle import random_prompt

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not can_quantize(), reason="fbgemm does not run on this CPU/torch"),
]

CPU = torch.device("cpu")
QUANT_CLASSES = [Fp16Linear, Int8Linear]


def random_linear(rows: int, seed: int, with_bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 80, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    x[0, 3] = 40.0  # an outlier channel, as real hidden states have
    return weight, bias, x


def emulated_int8(x, weight, bias):
    """What Int8Linear claims to compute, in fp64: per-token activations on fbgemm's
    reduce_range grid for [-1, 1] (scale 2/127, zero point 64: codes -64..64 around it),
    per-channel int8 weights."""
    codes, scales = quantize_per_channel(weight)
    row_max = x.double().abs().amax(dim=1, keepdim=True)
    step = 2 / 127
    q = torch.clamp(torch.round(x.double() / row_max / step + 64), 0, 255)
    y = ((q - 64) * step) @ (codes.double() * scales.double()[:, None]).T * row_max
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_int8_computes_per_token_int8_arithmetic(rows: int, with_bias: bool) -> None:
    weight, bias, x = random_linear(rows, seed=rows, with_bias=with_bias)
    out = Int8Linear(weight, bias)(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), emulated_int8(x, weight, bias), atol=1e-4, rtol=1e-4)
    # ...and that arithmetic is near the exact product (7-bit activations: a few % per row).
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    error = (out.double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.05


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp16_is_the_matmul_of_fp16_weights_in_fp32(rows: int) -> None:
    weight, bias, x = random_linear(rows, seed=rows)
    out = Fp16Linear(weight, bias)(x)
    expected = F.linear(x.double(), weight.half().double(), bias.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("linear_class", QUANT_CLASSES, ids=lambda c: c.__name__)
def test_a_row_does_not_depend_on_the_rest_of_the_batch(linear_class) -> None:
    weight, bias, x = random_linear(17, seed=3)
    x[5] *= 1000.0  # a loud neighbour would move a per-tensor activation scale
    x[6] = 0.0
    layer = linear_class(weight, bias)
    together = layer(x)
    for start, stop in ((0, 1), (4, 7), (6, 7), (2, 17)):
        assert torch.equal(layer(x[start:stop]), together[start:stop])
    torch.testing.assert_close(together[6], bias)  # an all-zero row gives the bias


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantize_model_replaces_every_linear_and_the_head(make_tiny_model, mode, tied):
    model_dir = make_tiny_model("llama", tie_word_embeddings=tied)
    model = load_model(EngineConfig(model=str(model_dir)), CPU, torch.float32).model
    num_linears = sum(isinstance(m, nn.Linear) for m in model.model.modules())
    expected_class = {"fp16": Fp16Linear, "int8": Int8Linear}[mode]
    assert quantize_model(model, mode, CPU, torch.float32) == num_linears + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, expected_class)
    assert isinstance(model.model.embed_tokens, nn.Embedding)  # the lookup stays fp32


@pytest.mark.parametrize(
    ("device", "dtype"),
    [(torch.device("cuda"), torch.float32), (CPU, torch.bfloat16), (CPU, torch.float16)],
)
def test_quantization_off_cpu_float32_is_refused(tiny_llama_dir, device, dtype) -> None:
    model = load_model(EngineConfig(model=str(tiny_llama_dir)), CPU, torch.float32).model
    with pytest.raises(ParamError, match="float32 only") as caught:
        quantize_model(model, "int8", device, dtype)
    assert caught.value.param == "quantization"
    assert quantize_model(model, "none", device, dtype) == 0  # none touches nothing


def test_quantization_where_the_probe_says_no_avx2_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir
) -> None:
    monkeypatch.setenv(capabilities.ISA_ENV, "baseline")
    capabilities.cpu_capabilities.cache_clear()
    try:
        assert not can_quantize()
        model = load_model(EngineConfig(model=str(tiny_llama_dir)), CPU, torch.float32).model
        with pytest.raises(ParamError, match="AVX2"):
            quantize_model(model, "fp16", CPU, torch.float32)
    finally:
        capabilities.cpu_capabilities.cache_clear()


def test_unknown_mode_names_the_key() -> None:
    with pytest.raises(ParamError, match="quantization must be none, native, q8_0, fp16 or int8"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize(
    ("mode", "kv_cache_dtype", "model_dtype", "expected"),
    [
        ("none", "auto", "float32", "float32"),  # exact: the model's own, as HF's
        ("fp16", "auto", "float32", "float32"),
        ("native", "auto", "float32", "float16"),  # block weights: half the KV bytes
        ("q8_0", "auto", "float32", "float16"),
        ("native", "float32", "float32", "float32"),  # an explicit choice wins
        ("none", "bfloat16", "float32", "bfloat16"),
        ("none", "auto", "bfloat16", "bfloat16"),
    ],
)
def test_the_kv_cache_dtype_auto_is_float16_under_block_weights(
    mode: str, kv_cache_dtype: str, model_dtype: str, expected: str
) -> None:
    config = EngineConfig(quantization=mode, kv_cache_dtype=kv_cache_dtype)
    assert config.kv_dtype_name(model_dtype) == expected


def test_an_unknown_kv_cache_dtype_names_the_key() -> None:
    with pytest.raises(ParamError, match="kv_cache_dtype must be auto, float32, bfloat16 or"):
        EngineConfig(kv_cache_dtype="fp8")


def runner_for(model_dir, mode: str) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir), quantization=mode, attention_backend="torch",
        block_size=8, num_kv_blocks=32,
    )  # fmt: skip
    return ModelRunner(config)


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_scorer_reads_hf_log_softmax_in_the_exact_mode(tiny_llama_dir) -> None:
    ids = random_prompt(45, seed=8)
    runner = runner_for(tiny_llama_dir, "none")
    assert isinstance(runner.model.lm_head, PackedLinear)  # none keeps the exact fp32 path
    score = score_text(runner, ids, chunk_tokens=16)  # three chunks through the paged cache
    expected = hf_logprobs(tiny_llama_dir, ids)[:-1]
    nll = -expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(score.nll, nll, atol=1e-4, rtol=1e-4)
    assert torch.equal(score.top1_ids, expected.argmax(dim=1))
    same = compare(score, score)
    assert (same.top1_agreement, same.perplexity_ratio) == (1.0, 1.0)


@pytest.mark.parametrize(("mode", "tolerance"), [("fp16", 2e-3), ("int8", 0.1)])
@pytest.mark.parametrize("isa", ["probe", "avx2"])
def test_quantized_runner_tracks_hf(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir, mode: str, tolerance: float, isa: str
) -> None:
    """The engine's quantized model stays near HF's fp32 logits, on this CPU's path and with
    the probe forced to AVX2 (KVSHARE_CPU_ISA=avx2, what an AVX2-only CPU gets)."""
    if isa == "avx2":
        monkeypatch.setenv(capabilities.ISA_ENV, "avx2")
    capabilities.cpu_capabilities.cache_clear()
    try:
        ids = random_prompt(30, seed=9)
        score = score_text(runner_for(tiny_llama_dir, mode), ids, chunk_tokens=11)
    finally:
        capabilities.cpu_capabilities.cache_clear()
    expected = hf_logprobs(tiny_llama_dir, ids)[:-1]
    nll = -expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (score.nll - nll).abs().max() < tolerance * nll.abs().max()


@pytest.mark.parametrize(
    ("mode", "dtype", "expected"),
    [("none", torch.float32, 1e-3), ("fp16", torch.float32, 1e-3), ("int8", torch.float32, 0.2),
     ("none", torch.bfloat16, 0.25)],
)  # fmt: skip
def test_audit_tolerance_follows_the_mode(mode: str, dtype: torch.dtype, expected: float) -> None:
    config = EngineConfig(quantization=mode, audit_tolerance_int8=0.2)
    assert audit_tolerance(config, dtype) == expected
