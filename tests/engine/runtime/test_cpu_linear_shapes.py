"""PackedLinear hands oneDNN a bounded set of row counts (engine/runtime/cpu/linear.py).

oneDNN keeps native state per row count it has seen, so a server whose prefill chunks take
every length grew without end. The bound is counted here, not timed: the distinct row counts
that reach oneDNN over every length up to 4096, and the padding each length costs. The padded
output is checked against F.linear on the same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runtime.cpu import linear
from engine.runtime.cpu.linear import PackedLinear, padded_rows

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN linear"
)


def test_padded_rows_take_few_sizes_and_little_padding() -> None:
    sizes = {padded_rows(rows) for rows in range(1, 4097)}
    assert len(sizes) == 32 + 7 * 8  # exact up to 32, then 8 sizes per doubling
    for rows in range(1, 4097):
        padded = padded_rows(rows)
        assert rows <= padded <= rows + rows // 8, rows
        assert padded_rows(padded) == padded  # a padded size needs no more padding
    assert [padded_rows(rows) for rows in (1, 32, 33, 64, 65, 512, 513, 1000)] == [
        1, 32, 36, 64, 72, 512, 576, 1024,
    ]  # fmt: skip


@needs_onednn
def test_every_row_count_reaches_onednn_as_one_of_the_bounded_sizes(monkeypatch) -> None:
    seen: set[int] = set()
    onednn_linear = linear._onednn_linear

    def spy(x, packed, bias):
        seen.add(x.shape[0])
        return onednn_linear(x, packed, bias)

    monkeypatch.setattr(linear, "_onednn_linear", spy)
    layer = PackedLinear(torch.randn(16, 8), None)
    with torch.inference_mode():
        for rows in range(1, 1025):
            assert layer(torch.randn(rows, 8)).shape == (rows, 16)
    assert len(seen) == 32 + 5 * 8  # 1024 row counts, 72 shapes for oneDNN
    assert seen == {padded_rows(rows) for rows in range(1, 1025)}


@needs_onednn
@pytest.mark.parametrize("rows", [33, 100, 1000])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_padded_rows_give_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
