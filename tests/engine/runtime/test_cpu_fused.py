"""The fused CPU elementwise ops against the torch code they replace in runtime/models/ (llama.py,
rope.py), once per kernel build level this CPU executes (available_isa_levels())."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.runtime.cpu.capabilities import available_isa_levels
from engine.runtime.cpu.fused import CpuFusedOps
from engine.runtime.cpu.native import load_library
from engine.runtime.models.llama import RMSNorm
from engine.runtime.models.rope import apply_rope

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(scope="module", params=available_isa_levels())
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuFusedOps:
    # The session's build dir, shared with attention/test_cpu_native.py: one build per level.
    build_dir = tmp_path_factory.getbasetemp() / "native-kernels"
    return CpuFusedOps(load_library(build_dir, request.param))


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_matches(out: torch.Tensor | None, expected: torch.Tensor) -> None:
    """fp32: to rounding; bf16: bit for bit but for rare one-ulp ties of an fp32 intermediate."""
    assert out is not None and out.dtype == expected.dtype and out.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)
    assert (out == expected).float().mean() > 0.99


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm(ops: CpuFusedOps, dtype: torch.dtype, num_tokens: int) -> None:
    norm = RMSNorm(96, 1e-5, torch.device("cpu"), dtype)
    norm.weight.data = randn(96, dtype=dtype, seed=1).abs() + 0.5
    x = randn(num_tokens, 96, dtype=dtype) * 3
    expected = norm(x)  # the torch path: no fused ops set
    assert_matches(ops.rms_norm(x, norm.weight.data, norm.eps), expected)


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 33, 400])
def test_silu_mul(ops: CpuFusedOps, dtype: torch.dtype, num_tokens: int) -> None:
    gate_up = randn(num_tokens, 2 * 160, dtype=dtype) * 4  # large |gate| both ways
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(ops.silu_mul(gate_up), F.silu(gate) * up)


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 33, 400])
def test_gelu_tanh_mul(ops: CpuFusedOps, dtype: torch.dtype, num_tokens: int) -> None:
    """Gemma's gate against GELU-tanh in float64, rounded where Gemma3MLP's torch code rounds.
    Written as g sigmoid(2y): torch's g / 2 (1 + tanh(y)) cancels below g = -3 (wrong in the
    leading digit in fp32, 0 for g < -7 even in float64), which the kernel does not."""
    gate_up = randn(num_tokens, 2 * 160, dtype=dtype) * 4
    gate_up[0, :16] = torch.tensor([1e-6, -1e-6, 1e-3, -1e-3, 0.0, 9.0, -9.0, 30.0] * 2)
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.double()
    gelu = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))
    assert_matches(ops.gelu_tanh_mul(gate_up), gelu.to(dtype) * up)
    tail = gate > -3  # where torch's own formula keeps its bits
    assert_matches(ops.gelu_tanh_mul(gate_up)[tail], (F.gelu(gate, approximate="tanh") * up)[tail])


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_qk_norm_is_rms_norm_on_each_head_in_place(
    ops: CpuFusedOps, dtype: torch.dtype, num_tokens: int
) -> None:
    """Query heads by q's weight, key heads by k's, V untouched; each head's values exactly what
    the fused rms_norm gives the same rows, and the torch RMSNorm's to rounding."""
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 3
    q_weight = randn(head_dim, dtype=dtype, seed=1).abs() + 0.5
    k_weight = randn(head_dim, dtype=dtype, seed=2).abs() + 0.5
    before = qkv.clone()
    assert ops.qk_norm(qkv, heads, kv_heads, q_weight, k_weight, 1e-6)
    q, k, v = before.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    for part, out, weight in ((q, qkv[:, : heads * head_dim], q_weight),
                              (k, qkv[:, heads * head_dim : (heads + kv_heads) * head_dim],
                               k_weight)):  # fmt: skip
        rows = part.reshape(-1, head_dim)
        assert torch.equal(out.reshape(-1, head_dim), ops.rms_norm(rows, weight, 1e-6))
        norm = RMSNorm(head_dim, 1e-6, torch.device("cpu"), dtype)
        norm.weight.data = weight
        assert_matches(out.reshape(-1, head_dim), norm(rows))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v)
    assert not ops.qk_norm(qkv[:, :-16], heads, kv_heads, q_weight, k_weight, 1e-6)


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rope_on_a_strided_view(ops: CpuFusedOps, dtype: torch.dtype, num_tokens: int) -> None:
    heads, head_dim = 3, 64
    qkv = randn(num_tokens, 5 * head_dim, dtype=dtype)  # q of 3 heads, then other columns
    x = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # not contiguous
    angles = randn(num_tokens, 1, head_dim // 2, dtype=torch.float32, seed=2) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = ops.rope(x, cos, sin)
    assert out is not None and out.is_contiguous()
    assert_matches(out, apply_rope(x, (cos, sin)))


def test_calls_it_does_not_cover_return_none(ops: CpuFusedOps) -> None:
    x = randn(4, 40, dtype=torch.float32)  # 40: not whole vectors of 16
    assert ops.rms_norm(x, torch.ones(40), 1e-5) is None
    assert ops.rms_norm(randn(4, 64, dtype=torch.float16), torch.ones(64).half(), 1e-5) is None
    assert ops.rms_norm(randn(64, 4, dtype=torch.float32).t(), torch.ones(64), 1e-5) is None
    assert ops.silu_mul(randn(4, 2 * 24, dtype=torch.float32)) is None
    cos = sin = torch.ones(4, 1, 8)
    assert ops.rope(randn(4, 2, 16, dtype=torch.float32), cos, sin) is None  # half = 8


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 200, 49152])
def test_argmax_is_torch_argmax(ops: CpuFusedOps, cols: int) -> None:
    logits = randn(5, cols) * 10
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


def test_argmax_ties_infinities_and_nans_as_torch(ops: CpuFusedOps) -> None:
    inf, nan = float("inf"), float("nan")
    rows = torch.full((9, 100), -1.0)
    rows[0, [3, 40, 97]] = 5.0  # ties across lanes and the tail: the first wins
    rows[1, [19, 35]] = 5.0  # ties within one lane
    rows[2, [50, 99]] = inf
    rows[3] = -inf  # all -inf: index 0
    rows[4, [20, 70]] = nan  # the first NaN beats everything
    rows[5, 98] = nan  # a NaN in the tail only
    rows[6, [10, 11]] = torch.tensor([inf, -inf])  # both infinities (sum NaN), no NaN: +inf
    rows[6, 60] = -inf
    rows[7, 0] = nan
    rows[8, 99] = 7.0  # the largest value in the tail
    assert torch.equal(ops.argmax(rows), rows.argmax(dim=-1))
    assert ops.argmax(rows).tolist() == [3, 19, 50, 0, 20, 98, 10, 0, 99]


def test_argmax_declines_what_it_does_not_take(ops: CpuFusedOps) -> None:
    assert ops.argmax(randn(3, 64).t()) is None  # not contiguous
    assert ops.argmax(randn(3, 64).double()) is None
    assert ops.argmax(randn(64)) is None  # one dimension
