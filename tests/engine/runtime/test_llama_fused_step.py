"""The fused step ops (residual add + RMSNorm, rope + KV store, the few-row LM head) against
the torch code they replace, and a tiny Llama running through them against HF's logits."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine.core.batch import ScheduledSeq
from engine.core.config import EngineConfig
from engine.runtime.attention import cpu_native
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu.capabilities import available_isa_levels
from engine.runtime.cpu.fused import GEMV_MAX_ROWS, CpuFusedOps
from engine.runtime.cpu.native import load_library
from engine.runtime.loader import load_model
from engine.runtime.models.llama import RMSNorm
from engine.runtime.models.rope import apply_rope
from engine.runtime.step_inputs import prepare_inputs
from tests.engine.runtime.test_cpu_fused import assert_matches, randn
from tests.oracle import random_prompt

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler"),
    pytest.mark.usefixtures("single_thread"),
]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=available_isa_levels())
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # The session's build dir, shared with the other native tests: one build per level.
    return load_library(tmp_path_factory.getbasetemp() / "native-kernels", request.param)


@pytest.fixture(scope="module")
def ops(library) -> CpuFusedOps:
    return CpuFusedOps(library)


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 9, 300])
def test_add_rms_norm_is_the_add_then_the_norm(ops, dtype, num_tokens) -> None:
    norm = RMSNorm(96, 1e-5, CPU, dtype)  # no fused ops: the torch path is the reference
    norm.weight.data = randn(96, dtype=dtype, seed=1).abs() + 0.5
    x, delta = randn(num_tokens, 96, dtype=dtype) * 3, randn(num_tokens, 96, dtype=dtype, seed=2)
    expected_sum, expected = norm.add_forward(x, delta)
    stream = x.clone()
    out = ops.add_rms_norm(stream, delta, norm.weight.data, norm.eps)
    assert out is not None
    assert torch.equal(stream, expected_sum)  # the sum is written into the stream, rounded once
    assert_matches(out, expected)


def _rope_case(num_tokens: int, dtype: torch.dtype, heads=4, kv_heads=2, head_dim=64):
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = randn(num_tokens, 1, head_dim // 2, seed=3) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [randn(6, 8, kv_heads, head_dim, dtype=dtype, seed=4 + i) for i in range(2)]
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(5))[:num_tokens]
    return qkv, (cos, sin), caches, slots


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_rope_store_is_rope_then_store_kv(ops, dtype, num_tokens) -> None:
    heads, kv_heads, head_dim = 4, 2, 64
    qkv, rope, (k_cache, v_cache), slots = _rope_case(num_tokens, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rope(q.view(num_tokens, heads, head_dim), rope)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    rotated_k = apply_rope(k.reshape(num_tokens, kv_heads, head_dim), rope)
    TorchRefBackend().store_kv(
        rotated_k, v.reshape(num_tokens, kv_heads, head_dim), expected_k, expected_v, slots
    )
    out = ops.rope_store(qkv, heads, *rope, k_cache, v_cache, slots)
    assert out is not None
    assert_matches(out, expected_q)
    assert_matches(k_cache, expected_k)  # every other slot untouched
    assert torch.equal(v_cache, expected_v)  # V is copied, not computed


def test_rope_store_refuses_a_slot_outside_the_cache_and_writes_nothing(ops) -> None:
    qkv, rope, (k_cache, v_cache), slots = _rope_case(3, torch.float32)
    slots[2] = 48  # one past the last slot
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(IndexError, match="slot"):
        ops.rope_store(qkv, 4, *rope, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_rope_store_declines_what_it_does_not_cover(ops) -> None:
    qkv, rope, (k_cache, v_cache), slots = _rope_case(3, torch.float32)
    assert ops.rope_store(qkv, 4, *rope, k_cache, v_cache, slots.int()) is None  # int32 slots
    assert ops.rope_store(qkv[:, :-64], 4, *rope, k_cache, v_cache, slots) is None  # wrong width
    half = torch.zeros(6, 8, 2, 64, dtype=torch.float16)
    assert ops.rope_store(qkv, 4, *rope, half, half, slots) is None  # another cache dtype


@DTYPES
@pytest.mark.parametrize("num_rows", list(range(1, GEMV_MAX_ROWS + 1)))
def test_gemv_is_f_linear(ops, dtype, num_rows) -> None:
    x, weight = randn(num_rows, 576, dtype=dtype), randn(1000, 576, dtype=dtype, seed=1)
    out = ops.gemv(x, weight)
    expected = F.linear(x.double(), weight.double())
    assert out is not None and out.dtype == dtype and out.shape == (num_rows, 1000)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_gemv_leaves_larger_batches_to_the_matmul(ops) -> None:
    assert ops.gemv(randn(GEMV_MAX_ROWS + 1, 64), randn(10, 64)) is None
    assert ops.gemv(randn(1, 40), randn(10, 40)) is None  # 40: not whole vectors


# -- the model through the fused ops ---------------------------------------------------------

BLOCK_SIZE = 8


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_llama_through_the_fused_ops_matches_hf(library, make_tiny_model, make_step, tied):
    # head_dim 64: rope_store and the native decode kernel both cover it.
    model_dir = make_tiny_model("llama", head_dim=64, tie_word_embeddings=tied)
    model = load_model(EngineConfig(model=str(model_dir)), CPU, torch.float32).model
    model.pack_for_cpu()
    ops = CountingOps(library)
    model.use_fused_ops(ops)
    backend = cpu_native.CpuNativeBackend(library)
    spec = model.spec
    shape = (16, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    a, b = random_prompt(20, seed=2), random_prompt(13, seed=3)

    def last_logits(seqs, num_decodes=0) -> torch.Tensor:
        """Each sequence's last-row logits [B, V]."""
        inputs = prepare_inputs(make_step(seqs, BLOCK_SIZE, num_decodes), CPU)
        last_rows = [end - 1 for end in inputs.meta.query_start_loc_host[1:]]
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, inputs.meta, kv, backend)
            return model.compute_logits(hidden[last_rows])

    prefill = last_logits(
        [ScheduledSeq(0, a[:18], 0, [0, 1, 2]), ScheduledSeq(1, b[:11], 0, [3, 4])]
    )
    # Decode-only steps of two rows and of one: the native decode kernel, the LM head's gemv.
    decode = last_logits(
        [ScheduledSeq(0, a[18:19], 18, [0, 1, 2]), ScheduledSeq(1, b[11:12], 11, [3, 4])], 2
    )
    single = last_logits([ScheduledSeq(0, a[19:], 19, [0, 1, 2])], 1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected_a = hf(torch.tensor([a])).logits[0]
        expected_b = hf(torch.tensor([b[:12]])).logits[0]
    expected = [expected_a[17], expected_b[10], expected_a[18], expected_b[11], expected_a[19]]
    ours = [*prefill, *decode, *single]
    for row, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
    # Every layer of the 3 steps went through the fused ops; so did each step's 1-2 head rows
    # where the head has a plain weight (tied: the embedding), not when it is packed alone.
    num_layers = spec.num_layers
    expected_calls = {"rope_store": 3 * num_layers, "add_rms_norm": 3 * 2 * num_layers}
    assert ops.calls == {**expected_calls, **({"gemv": 3} if tied else {})}


class CountingOps(CpuFusedOps):
    """CpuFusedOps that counts the calls its fused step ops served (not declined)."""

    def __init__(self, library) -> None:
        super().__init__(library)
        self.calls: dict[str, int] = {}

    def _count(self, name: str, out):
        if out is not None:
            self.calls[name] = self.calls.get(name, 0) + 1
        return out

    def rope_store(self, *args):
        return self._count("rope_store", super().rope_store(*args))

    def add_rms_norm(self, *args):
        return self._count("add_rms_norm", super().add_rms_norm(*args))

    def gemv(self, *args):
        return self._count("gemv", super().gemv(*args))
