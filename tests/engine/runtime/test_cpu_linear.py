"""PackedLinear (oneDNN, packed weights) against F.linear, and the swap of a module tree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.cpu.linear import PackedLinear, can_pack, pack_linears

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not can_pack(CPU, torch.float32), reason="this torch build has no oneDNN linear"
)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_f_linear(dtype: torch.dtype, tolerance: float, rows: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 48) and out.dtype == dtype
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_pack_linears_swaps_every_linear_in_the_tree() -> None:
    tree = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 4), nn.ReLU()]))
    x = torch.randn(3, 8)
    before = tree[1][0](tree[0](x))
    assert pack_linears(tree) == 2
    assert isinstance(tree[0], PackedLinear) and isinstance(tree[1][0], PackedLinear)
    assert isinstance(tree[1][1], nn.ReLU)
    torch.testing.assert_close(tree[1][0](tree[0](x)), before, atol=1e-5, rtol=1e-5)


def test_only_cpu_float32_and_bfloat16_are_packed() -> None:
    assert can_pack(CPU, torch.bfloat16)
    assert not can_pack(CPU, torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)
