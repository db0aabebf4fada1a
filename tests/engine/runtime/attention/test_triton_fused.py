"""TritonFusedOps against the torch code it replaces in the models, on the CPU through the
Triton interpreter, and tiny models run with and without it.

TRITON_INTERPRET=1 must be set before triton is imported (triton.jit picks the interpreter
when it decorates), so it is set here, for the rest of the session. If something imported
triton earlier in this process, these tests run in a fresh process instead. Shapes are tiny
and odd (row lengths 40, 72; head dims 24, 40, 64): the kernels pad them to powers of two.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (the kernels take CUDA tensors here)", allow_module_level=True)

from tests.engine.runtime.attention.interpreter import (
    claim_interpreter,
    run_in_fresh_process,
)

_CAN_INTERPRET_HERE = claim_interpreter()
pytest.importorskip("triton")

from engine.core.batch import ScheduledSeq  # noqa: E402
from engine.runtime.attention import triton_fused  # noqa: E402
from engine.runtime.attention.torch_ref import TorchRefBackend  # noqa: E402
from engine.runtime.models.llama import LlamaForCausalLM, RMSNorm  # noqa: E402
from engine.runtime.models.rope import apply_rope  # noqa: E402
from engine.runtime.step_inputs import prepare_inputs  # noqa: E402
from tests.oracle import random_prompt  # noqa: E402

if _CAN_INTERPRET_HERE and not triton_fused.INTERPRETED:
    importlib.reload(triton_fused)  # an earlier import built the kernels for a GPU: rebuild

# the interpreter's numpy warns where exp overflows to inf, as the kernels let it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
interpreted = pytest.mark.skipif(
    not _CAN_INTERPRET_HERE,
    reason="triton was imported before TRITON_INTERPRET=1; test_in_fresh_process runs these",
)

CPU = torch.device("cpu")
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


@pytest.mark.skipif(_CAN_INTERPRET_HERE, reason="the tests below run in this process")
def test_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def ops() -> triton_fused.TritonFusedOps:
    return triton_fused.TritonFusedOps()  # looked up at call time: the module may be reloaded


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# One ulp relative to the value (fp16: and one subnormal step near 0).
_ULP = {torch.bfloat16: (2.0**-7, 0.0), torch.float16: (2.0**-10, 2.0**-24)}


def assert_torch_rounding(out: torch.Tensor | None, expected: torch.Tensor) -> None:
    """fp32: to a few ulp (the kernels sum in their own order, and exp and rsqrt are not
    torch's implementations); bf16/fp16: torch's bits, since every step rounds where torch
    rounds, but where such an fp32 difference straddles a rounding boundary: one ulp, rarely."""
    assert out is not None and out.dtype == expected.dtype and out.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        return
    rtol, atol = _ULP[expected.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert (out == expected).float().mean() >= 0.99


def torch_norm(size: int, dtype: torch.dtype, eps: float = 1e-5) -> RMSNorm:
    """The model's RMSNorm with no fused ops (its torch code: the reference), a random weight."""
    norm = RMSNorm(size, eps, CPU, dtype)
    norm.weight.data = randn(size, dtype=torch.float32, seed=1).abs().add(0.5).to(dtype)
    return norm


# -- RMSNorm ---------------------------------------------------------------------------------


@interpreted
@DTYPES
@pytest.mark.parametrize(("num_rows", "size"), [(1, 72), (9, 40), (5, 64)])
def test_rms_norm_is_the_torch_norm(dtype: torch.dtype, num_rows: int, size: int) -> None:
    norm = torch_norm(size, dtype)
    x = randn(num_rows, size, dtype=dtype) * 3
    assert_torch_rounding(ops().rms_norm(x, norm.weight.data, norm.eps), norm(x))


@interpreted
@DTYPES
def test_rms_norm_of_strided_heads(dtype: torch.dtype) -> None:
    # Qwen3's q_norm: each head of q, a [T, H, D] view of the fused qkv rows
    num_tokens, heads, kv_heads, head_dim = 5, 3, 1, 40
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 2
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    norm = torch_norm(head_dim, dtype, eps=1e-6)
    out = ops().rms_norm(q, norm.weight.data, norm.eps)
    assert out is not None and out.is_contiguous()
    assert_torch_rounding(out, norm(q))


@interpreted
@DTYPES
@pytest.mark.parametrize(("num_rows", "size"), [(1, 72), (7, 40)])
def test_add_rms_norm_is_the_add_then_the_norm(
    dtype: torch.dtype, num_rows: int, size: int
) -> None:
    norm = torch_norm(size, dtype)
    x, delta = randn(num_rows, size, dtype=dtype) * 3, randn(num_rows, size, dtype=dtype, seed=2)
    expected_sum, expected = norm.add_forward(x, delta)
    stream = x.clone()
    out = ops().add_rms_norm(stream, delta, norm.weight.data, norm.eps)
    assert torch.equal(stream, expected_sum)  # the sum written into the stream, rounded once
    assert_torch_rounding(out, expected)


# -- gated activations -----------------------------------------------------------------------


@interpreted
@DTYPES
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 40), (6, 20)])
def test_silu_mul_is_the_llama_mlp_gate(dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    gate_up = randn(num_tokens, 2 * inter, dtype=dtype) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 30.0, -30.0, 100.0, -100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    assert_torch_rounding(ops().silu_mul(gate_up), F.silu(gate).mul_(up))  # LlamaMLP's code


@interpreted
@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_gelu_tanh_mul_is_the_gemma_mlp_gate(dtype: torch.dtype, num_tokens: int) -> None:
    """Against GELU-tanh in float64 rounded where Gemma3MLP rounds, and against torch's own
    formula where it keeps its bits (g > -3: below, its 1 + tanh(y) cancels; see gemma3.py)."""
    gate_up = randn(num_tokens, 2 * 40, dtype=dtype) * 4
    gate_up[0, :8] = torch.tensor([1e-6, -1e-6, 1e-3, -1e-3, 0.0, 9.0, -9.0, 30.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops().gelu_tanh_mul(gate_up)
    g = gate.double()
    exact = (g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))).to(dtype) * up
    if dtype == torch.float32:  # the kernel's fp32 exp against float64: a few ulp
        torch.testing.assert_close(out, exact, atol=1e-6, rtol=1e-5)
    else:
        assert_torch_rounding(out, exact)
    tail = gate > -3
    assert_torch_rounding(out[tail], (F.gelu(gate, approximate="tanh") * up)[tail])


# -- rope and the KV store -------------------------------------------------------------------

# (H, Hkv, D, block_size): odd head counts and head dims, GQA 3 and 1
ROPE_SHAPES = [(3, 1, 24, 4), (6, 2, 40, 8), (4, 4, 64, 8)]


def rope_case(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, cache_dtype):
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = randn(num_tokens, 1, head_dim // 2, seed=3) * 3
    rope = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [randn(4, 8, kv_heads, head_dim, dtype=cache_dtype, seed=4 + i) for i in range(2)]
    return qkv, rope, caches


def rope_then_store(qkv, heads, rope, k_cache, v_cache, slots) -> torch.Tensor:
    """LlamaAttention's torch code: apply_rope on q and k, then store_kv of the real tokens
    (TorchRefBackend's index_copy_ takes no padding slot); the rotated q."""
    num_tokens, (kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k = apply_rope(k.reshape(num_tokens, kv_heads, head_dim), rope)
    real = slots >= 0
    v = v.reshape(num_tokens, kv_heads, head_dim)
    TorchRefBackend().store_kv(k[real], v[real], k_cache, v_cache, slots[real])
    return apply_rope(q.view(num_tokens, heads, head_dim), rope)


@interpreted
@DTYPES
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), ROPE_SHAPES)
def test_rope_store_is_rope_then_store_kv(dtype, heads, kv_heads, head_dim, block_size) -> None:
    """Bit for bit in every dtype: only products and sums, each rounded where torch rounds."""
    qkv, rope, (k_cache, v_cache) = rope_case(5, heads, kv_heads, head_dim, dtype, dtype)
    k_cache = k_cache.view(-1, block_size, kv_heads, head_dim)
    v_cache = v_cache.view(-1, block_size, kv_heads, head_dim)
    slots = torch.tensor([3, block_size + 5, -1, 3 * block_size, 0])  # -1: a padding token
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = rope_then_store(qkv, heads, rope, expected_k, expected_v, slots)
    q = ops().rope_store(qkv, heads, *rope, k_cache, v_cache, slots)
    assert q is not None and torch.equal(q, expected_q)
    assert torch.equal(k_cache, expected_k)  # every other slot untouched
    assert torch.equal(v_cache, expected_v)


@interpreted
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_rope_store_rounds_fp32_activations_into_a_half_cache(cache_dtype) -> None:
    qkv, rope, (k_cache, v_cache) = rope_case(4, 3, 1, 24, torch.float32, cache_dtype)
    slots = torch.tensor([9, 0, 31, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = rope_then_store(qkv, 3, rope, expected_k, expected_v, slots)
    q = ops().rope_store(qkv, 3, *rope, k_cache, v_cache, slots.int())  # int32 slots too
    assert q is not None and torch.equal(q, expected_q)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@interpreted
def test_rope_store_drops_a_slot_past_the_pool() -> None:
    # The kernel cannot raise without a host sync; it writes nothing out of bounds instead.
    qkv, rope, (k_cache, v_cache) = rope_case(2, 3, 1, 24, torch.float32, torch.float32)
    before = k_cache.clone(), v_cache.clone()
    q = ops().rope_store(qkv, 3, *rope, k_cache, v_cache, torch.tensor([4 * 8, -1]))
    assert q is not None and torch.equal(q, apply_rope(qkv[:, :72].view(2, 3, 24), rope))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@interpreted
@DTYPES
def test_rope_of_a_strided_view_is_apply_rope(dtype: torch.dtype) -> None:
    qkv, rope, _ = rope_case(5, 6, 2, 40, dtype, dtype)
    k = qkv[:, 240:320].view(5, 2, 40)  # the key heads, rows strided as in qkv
    out = ops().rope(k, *rope)
    assert out is not None and out.is_contiguous() and torch.equal(out, apply_rope(k, rope))


# -- empty batches and what is not covered ---------------------------------------------------


@interpreted
def test_zero_rows_give_empty_results_without_a_launch(monkeypatch) -> None:
    for kernel in ("_rms_norm_kernel", "_gated_kernel", "_rope_kernel", "_rope_store_kernel"):
        monkeypatch.setattr(triton_fused, kernel, None)  # a launch would raise
    fused, weight = ops(), torch.ones(40)
    x, delta = torch.empty(0, 40), torch.empty(0, 40)
    assert ops().rms_norm(x, weight, 1e-5).shape == (0, 40)
    assert fused.add_rms_norm(x, delta, weight, 1e-5).shape == (0, 40)
    assert fused.silu_mul(torch.empty(0, 80, dtype=torch.bfloat16)).shape == (0, 40)
    assert fused.gelu_tanh_mul(torch.empty(0, 80)).shape == (0, 40)
    cos = sin = torch.empty(0, 1, 12)
    assert fused.rope(torch.empty(0, 3, 24), cos, sin).shape == (0, 3, 24)
    k_cache, v_cache = torch.zeros(2, 4, 1, 24), torch.zeros(2, 4, 1, 24)
    slots = torch.empty(0, dtype=torch.int64)
    q = fused.rope_store(torch.empty(0, 5 * 24), 3, cos, sin, k_cache, v_cache, slots)
    assert q.shape == (0, 3, 24) and not k_cache.any() and not v_cache.any()


class FailingKernel:
    """A kernel that fails to build, as one might on a first GPU: counts its launches."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.launches += 1
            raise RuntimeError("out of resources: shared memory")

        return launch


@interpreted
def test_a_kernel_that_fails_is_declined_and_the_model_runs_its_torch_code(monkeypatch) -> None:
    failing = FailingKernel()
    monkeypatch.setattr(triton_fused, "_rms_norm_kernel", failing)
    fused = ops()
    norm = RMSNorm(40, 1e-5, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        norm.weight.copy_(randn(40, seed=3))
    x = randn(5, 40)
    expected = norm(x)  # torch's code (no fused ops yet)
    norm.fused = fused
    assert fused.rms_norm(x, norm.weight, 1e-5) is None and fused.failed == {"rms_norm"}
    assert torch.equal(norm(x), expected)  # declined: the module ran its torch code
    summed, expected_normed = norm.add_forward(x.clone(), x)  # add + norm: declined too
    assert torch.equal(summed, x + x) and torch.equal(expected_normed, norm.forward(x + x))
    assert failing.launches == 1  # tried once, never again
    assert fused.silu_mul(randn(3, 80)) is not None  # the other kernels still serve


@interpreted
def test_uncovered_calls_are_declined() -> None:
    fused, x, weight = ops(), randn(3, 40), torch.ones(40)
    assert fused.rms_norm(x.t().contiguous().t(), weight, 1e-5) is None  # strided last dim
    assert fused.rms_norm(x.to(torch.bfloat16), weight, 1e-5) is None  # Gemma's fp32 weight
    assert fused.rms_norm(x.double(), weight.double(), 1e-5) is None  # float64
    assert fused.rms_norm(x.to("meta"), weight.to("meta"), 1e-5) is None  # another device
    assert fused.rms_norm(x, torch.ones(41), 1e-5) is None  # the weight's length
    wide = torch.ones(1, (1 << 16) + 1)
    assert fused.rms_norm(wide, torch.ones(wide.shape[1]), 1e-5) is None  # past one program
    assert fused.add_rms_norm(x.t(), x.t(), torch.ones(3), 1e-5) is None  # stream not in place
    assert fused.add_rms_norm(x, x[:2], weight, 1e-5) is None  # shapes differ
    assert fused.silu_mul(randn(3, 41)) is None  # odd width: no halves
    assert fused.gelu_tanh_mul(randn(3, 40).t()) is None
    qkv, rope, (k_cache, v_cache) = rope_case(3, 3, 1, 24, torch.float32, torch.float32)
    slots = torch.tensor([0, 1, 2])
    assert fused.rope_store(qkv[:, :-24], 3, *rope, k_cache, v_cache, slots) is None  # width
    assert fused.rope_store(qkv, 3, *rope, k_cache, v_cache, slots.float()) is None
    fp8 = k_cache.to(torch.float8_e4m3fn)
    assert fused.rope_store(qkv, 3, *rope, fp8, fp8, slots) is None  # a cache dtype not taken
    assert fused.rope_store(qkv, 3, *rope, k_cache, v_cache.half(), slots) is None
    half_rope = [t.to(torch.bfloat16) for t in rope]
    assert fused.rope_store(qkv, 3, *half_rope, k_cache, v_cache, slots) is None  # cos dtype
    assert fused.rope(randn(3, 2, 25), *rope) is None  # odd head dim
    assert fused.qk_norm(qkv, 3, 1, torch.ones(24), torch.ones(24), 1e-6) is False
    assert fused.gemv(x, randn(10, 40)) is None and fused.argmax(randn(2, 10)) is None


# -- the compiled path -----------------------------------------------------------------------

# Compiles every kernel for an sm_90 GPU, as the CUDA path builds them, with no GPU here.
_COMPILE_FOR_A_GPU = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from engine.runtime.attention import triton_fused as tf

assert not tf.INTERPRETED
POINTERS = {0: "*fp32", 1: "*i16", 2: "*fp16"}  # bf16 goes as its int16 bits
SCALARS = {"eps": "fp32", "size_fp32": "fp32", "num_slots": "i64"}  # the rest: i32
CONSTANTS = {"ADD": True, "BLOCK": 2048, "TILE": 1024, "BLOCK_SIZE": 16, "H_PAD": 32,
             "HKV_PAD": 8, "HEADS_PAD": 32, "HALF_PAD": 64}

def compile(kernel, kind, cache_kind=None, **constants):
    constants = {**CONSTANTS, "KIND": kind, "CACHE_KIND": cache_kind, **constants}
    signature = {}
    for name in kernel.arg_names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            cache = name.startswith(("k_cache", "v_cache"))
            slots = name == "slot_mapping_ptr"
            signature[name] = "*i64" if slots else POINTERS[cache_kind if cache else kind]
        else:
            signature[name] = SCALARS.get(name, "i32")
    constants = {k: v for k, v in constants.items() if k in signature}
    options = {"enable_fp_fusion": False}
    source = ASTSource(kernel, signature, constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "fma.rn.f32" not in ptx, kernel.fn.__name__  # torch rounds each product first

for kind in (0, 1, 2):
    compile(tf._rms_norm_kernel, kind)
    compile(tf._gated_kernel, kind, GELU=False)
    compile(tf._gated_kernel, kind, GELU=True)
    compile(tf._rope_kernel, kind)
for kind, cache_kind in [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2)]:
    compile(tf._rope_store_kernel, kind, cache_kind)
print("compiled")
"""


@interpreted
def test_kernels_compile_for_a_gpu(tmp_path: Path) -> None:
    """The interpreter runs the kernels' Python; this builds them as a GPU would (types,
    lowering, ptxas), without FMA contraction, in a process that does not interpret."""
    spec = importlib.util.find_spec("triton")
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no NVIDIA toolchain here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_A_GPU],
        cwd=Path(__file__).resolve().parents[4],
        env={**env, "TRITON_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


@interpreted
def test_every_launch_is_built_without_fma_contraction(monkeypatch) -> None:
    """What the compile test above checks holds only if each wrapper asks for it."""
    fusion: list = []

    class Recording:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                fusion.append(kwargs.get("enable_fp_fusion"))
                return self.kernel[grid](*args, **kwargs)

            return launch

    kernels = ("_rms_norm_kernel", "_gated_kernel", "_rope_kernel", "_rope_store_kernel")
    for kernel in kernels:
        monkeypatch.setattr(triton_fused, kernel, Recording(getattr(triton_fused, kernel)))
    fused, x = ops(), randn(2, 40)
    fused.rms_norm(x, torch.ones(40), 1e-5)
    fused.add_rms_norm(x, x.clone(), torch.ones(40), 1e-5)
    fused.silu_mul(x)
    fused.gelu_tanh_mul(x)
    qkv, rope, (k_cache, v_cache) = rope_case(2, 3, 1, 24, torch.float32, torch.float32)
    fused.rope(qkv[:, :72].view(2, 3, 24), *rope)
    fused.rope_store(qkv, 3, *rope, k_cache, v_cache, torch.tensor([0, 1]))
    assert fusion == [False] * 6


# -- tiny models through the fused ops -------------------------------------------------------

BLOCK_SIZE = 8
# (config class, overrides): odd shapes for Llama (GQA 3, head dim 24, rows of 72 and 40);
# Qwen3's q/k norms (per head, through rms_norm) with rope apart; Gemma 3's GELU and fp32 norms
TINY_MODELS = {
    "llama-odd": (
        "LlamaConfig",
        {"hidden_size": 72, "intermediate_size": 40, "num_attention_heads": 3,
         "num_key_value_heads": 1, "head_dim": 24},
    ),
    "qwen3-qk-norm": ("Qwen3Config", {"num_attention_heads": 6, "head_dim": 40}),
    "gemma3": (
        "Gemma3TextConfig",
        {"num_hidden_layers": 2, "head_dim": 40, "query_pre_attn_scalar": 24,
         "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}  # fmt: skip
SERVED = {
    "llama-odd": {"rms_norm", "add_rms_norm", "rope_store", "silu_mul"},
    "qwen3-qk-norm": {"rms_norm", "add_rms_norm", "rope", "silu_mul"},
    "gemma3": {"rms_norm", "add_rms_norm", "rope", "gelu_tanh_mul"},
}


class CountingOps:
    """TritonFusedOps that tallies the calls each method served and those it declined."""

    def __init__(self) -> None:
        self.ops = ops()
        self.served: Counter[str] = Counter()
        self.declined: Counter[str] = Counter()

    def __getattr__(self, name: str):
        method = getattr(self.ops, name)

        def call(*args):
            out = method(*args)
            (self.declined if out is None or out is False else self.served)[name] += 1
            return out

        return call


def tiny_model(name: str) -> LlamaForCausalLM:
    import transformers

    from engine.runtime.models.gemma3 import Gemma3ForCausalLM
    from tests.tiny_models import TINY_CONFIG

    config_class, overrides = TINY_MODELS[name]
    config = getattr(transformers, config_class)(**{**TINY_CONFIG, **overrides})
    model_class = Gemma3ForCausalLM if name == "gemma3" else LlamaForCausalLM
    model = model_class(config, max_positions=64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # skip_init left the parameters unset
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def run_steps(model: LlamaForCausalLM, make_step) -> tuple[list[torch.Tensor], list]:
    """A prefill of two sequences (blocks straddled), then a decode of both: each step's hidden
    rows, and the KV caches after."""
    spec = model.spec
    shape = (4, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    a, b = random_prompt(10, seed=1), random_prompt(7, seed=2)
    steps = [
        ([ScheduledSeq(0, a[:9], 0, [2, 0]), ScheduledSeq(1, b[:6], 0, [1])], 0),
        ([ScheduledSeq(0, a[9:], 9, [2, 0]), ScheduledSeq(1, b[6:], 6, [1])], 2),
    ]
    hidden = []
    for seqs, num_decodes in steps:
        inputs = prepare_inputs(make_step(seqs, BLOCK_SIZE, num_decodes), CPU)
        with torch.inference_mode():
            hidden.append(
                model(inputs.input_ids, inputs.positions, inputs.meta, kv, TorchRefBackend())
            )
    return hidden, kv


@interpreted
@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_with_the_fused_ops_matches_torch(name: str, make_step) -> None:
    model = tiny_model(name)
    expected_hidden, expected_kv = run_steps(model, make_step)
    counting = CountingOps()
    model.use_fused_ops(counting)
    hidden, kv = run_steps(model, make_step)
    for got, want in zip(hidden, expected_hidden, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(kv, expected_kv, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert set(counting.served) == SERVED[name]
    assert set(counting.declined) <= {"qk_norm"}  # every other call ran fused
