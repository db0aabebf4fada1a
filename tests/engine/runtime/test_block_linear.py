"""The GGUF block kernels (engine/runtime/cpu/block_tiles.cpp, fma_panels.cpp,
amx_panels.cpp) against F.linear on the weights as gguf-py dequantizes them, once per kernel
build level this CPU executes (the forced lower levels included), on odd shapes, in both
layouts (GGUF's rows, and the panels to_panels makes of every format: Q4_0, Q4_1, Q5_0 and
Q8_0 reordered, Q4_K and Q6_K per group); and batch invariance: a row's output is
bit-identical alone and among 3 or 8 rows, and with 1 or 2 threads."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from engine.runtime.cpu.block_linear import (
    BLOCK_FORMATS,
    K_PANEL_FORMATS,
    PANEL_FORMATS,
    BlockEmbedding,
    BlockLinear,
    BlockLinearParts,
    BlockWeight,
    concat_rows,
    format_runs,
    quantize_q8_0,
    to_panels,
    to_rows,
)
from engine.runtime.cpu.native import INTERFACE
from tests.engine.runtime.kernel_paths import kernel_path, kernel_paths

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

# Where each format keeps its fp16 scales (byte offset, typical magnitude): random codes
# with scales of sane size give weights of the size real checkpoints have.
_HALF_FIELDS = {
    "Q4_0": [(0, 0.01)],
    "Q4_1": [(0, 0.01), (2, 0.05)],
    "Q5_0": [(0, 0.005)],
    "Q8_0": [(0, 0.002)],
    "Q4_K": [(0, 0.001), (2, 0.002)],
    "Q6_K": [(208, 0.0005)],
}
FORMATS = list(BLOCK_FORMATS)
# Every format has panel kernels: the K-quants' panels are stored per group (k_panels.py).
ALL_PANEL_FORMATS = [*PANEL_FORMATS, *K_PANEL_FORMATS]
# (format, layout): every format in GGUF's row order and as panels.
LAYOUTS = [(fmt, "rows") for fmt in FORMATS] + [(fmt, "panels") for fmt in ALL_PANEL_FORMATS]


@pytest.fixture(scope="module", params=kernel_paths())
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # The session's build dir, shared with the other native kernel tests: one build per level.
    with kernel_path(tmp_path_factory.getbasetemp() / "native-kernels", request.param) as library:
        yield library


def random_blocks(fmt: str, out_features: int, in_features: int, seed: int) -> BlockWeight:
    """Random codes and scales in `fmt`'s layout: every bit pattern the format allows."""
    rng = np.random.default_rng(seed)
    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    num_blocks = in_features // per_block
    raw = rng.integers(0, 256, size=(out_features, num_blocks, size), dtype=np.uint8)
    for offset, scale in _HALF_FIELDS[fmt]:
        halves = (rng.standard_normal((out_features, num_blocks)) * scale).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(out_features, num_blocks, 2)
    data = torch.from_numpy(raw.reshape(out_features, num_blocks * size))
    return BlockWeight(fmt, data, in_features)


def laid_out(weight: BlockWeight, layout: str) -> BlockWeight:
    """weight in `layout`; panels only for whole panels of 16 rows (asserted: no silent rows)."""
    if layout == "rows":
        return weight
    panels = to_panels(weight)
    assert panels.layout == "panels" and panels.code == weight.code + 100
    return panels


def rows_for(layout: str, out_features: int) -> int:
    """out_features, rounded up to whole panels for the panel layout."""
    return out_features if layout == "rows" else -(-out_features // 16) * 16


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within fp32 summation error of the fp64 product: |err| <= 1e-5 * sum_k |x_k w_k|."""
    expected = F.linear(x.double(), weight.double())
    bound = F.linear(x.double().abs(), weight.double().abs()) * 1e-5 + 1e-12
    assert out.dtype == torch.float32
    assert ((out.double() - expected).abs() <= bound).all(), (out.double() - expected).abs().max()


def in_features_of(fmt: str, multiple: int) -> int:
    return BLOCK_FORMATS[fmt][1] * multiple


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
@pytest.mark.parametrize(
    ("out_features", "blocks_per_row"), [(1, 1), (7, 3), (13, 2), (130, 5), (80, 18)]
)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9])
def test_matches_f_linear_on_the_dequantized_weights(
    library, fmt: str, layout: str, out_features: int, blocks_per_row: int, rows: int
) -> None:
    out_features = rows_for(layout, out_features)
    weight = random_blocks(fmt, out_features, in_features_of(fmt, blocks_per_row), seed=rows)
    layer = BlockLinear(laid_out(weight, layout), None, library)
    x = randn(rows, weight.in_features, seed=out_features)
    assert_close_to_reference(layer(x), x, weight.dequantize())


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_a_rows_output_is_bit_identical_at_1_3_and_8_rows(library, fmt: str, layout: str) -> None:
    # 112 rows: a tile of 4 panels, a pair and one left over (panels); 37: odd (rows)
    weight = random_blocks(fmt, 37 if layout == "rows" else 112, in_features_of(fmt, 4), seed=1)
    layer = BlockLinear(laid_out(weight, layout), None, library)
    crowd = randn(8, weight.in_features, seed=2)
    alone = layer(crowd[5:6])
    assert torch.equal(layer(crowd[3:6])[2:3], alone)
    assert torch.equal(layer(crowd)[5:6], alone)
    # and the whole batch against each row alone
    assert torch.equal(layer(crowd), torch.cat([layer(crowd[i : i + 1]) for i in range(8)]))


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_each_row_takes_the_path_the_step_gives_it(library, fmt: str, layout: str) -> None:
    """tile_rows (AttentionMetadata.tile_rows, a prompt token's 1): a row marked 1 gets its
    prompt path's bits (kvshare_prompt_path: the tiles' as the library's default path, the
    FMAs', or kvshare_prefill_gemm's), a row marked 0 the FMAs' bits, in runs of either kind at
    either end."""
    weight = random_blocks(fmt, rows_for(layout, 40), in_features_of(fmt, 5), seed=11)
    stored = laid_out(weight, layout)
    layer = BlockLinear(stored, None, library)
    x = randn(19, weight.in_features, seed=12)
    paths = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1] + [1] * 9 + [0, 0], dtype=torch.int32)
    before = library.kvshare_panel_amx(-1)
    try:
        library.kvshare_panel_amx(0)
        fmas = layer(x)
        path = library.kvshare_prompt_path(stored.code)
        if path == INTERFACE.constants["kPromptTiles"]:
            assert library.kvshare_panel_amx(1)
            prompts = layer(x)
        elif path == INTERFACE.constants["kPromptFmas"]:
            prompts = fmas
        else:
            prompts = torch.empty_like(fmas)
            assert not library.kvshare_prefill_gemm(
                stored.code, x.data_ptr(), stored.data.data_ptr(), prompts.data_ptr(), 19,
                weight.in_features, weight.out_features, 2,
            )  # fmt: skip
    finally:
        library.kvshare_panel_amx(before)
    mixed = layer(x, paths)
    assert torch.equal(mixed, torch.where(paths[:, None].bool(), prompts, fmas))
    assert_close_to_reference(mixed, x, weight.dequantize())
    with pytest.raises(ValueError, match="tile_rows"):
        layer(x, paths[:-1])


@pytest.mark.parametrize("fmt", ALL_PANEL_FORMATS)
def test_many_rows_read_expanded_panels_with_the_same_bits(library, fmt: str) -> None:
    # From 64 rows a chunk's panels are expanded to fp32 once and read back by every row tile:
    # 70 rows (17 tiles of 4 and one of 2) of 112 outputs (a tile of 4 panels, a pair, one left)
    # give each row the bits it gets alone, on the expanding path.
    weight = random_blocks(fmt, 112, in_features_of(fmt, 5), seed=5)
    layer = BlockLinear(laid_out(weight, "panels"), None, library)
    crowd = randn(70, weight.in_features, seed=6)
    together = layer(crowd)
    assert torch.equal(together, torch.cat([layer(crowd[i : i + 1]) for i in range(70)]))
    assert_close_to_reference(together, crowd, weight.dequantize())


@pytest.mark.parametrize(
    ("fmt", "layout"),
    [("Q4_1", "rows"), ("Q6_K", "rows"), ("Q4_1", "panels"), ("Q5_0", "panels")],
)
def test_threads_split_outputs_never_the_sum(library, fmt: str, layout: str) -> None:
    weight = random_blocks(fmt, rows_for(layout, 50), in_features_of(fmt, 3), seed=3)
    layer = BlockLinear(laid_out(weight, layout), None, library)
    x = randn(4, weight.in_features, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_embedding_rows_are_the_dequantized_rows(library, fmt: str, layout: str) -> None:
    num_rows = rows_for(layout, 20)
    weight = random_blocks(fmt, num_rows, in_features_of(fmt, 2), seed=5)
    table = BlockEmbedding(laid_out(weight, layout), library)
    ids = torch.tensor([num_rows - 1, 0, 7, 7, 17])
    assert torch.equal(table(ids), weight.dequantize()[ids])
    with pytest.raises(IndexError):
        table(torch.tensor([num_rows]))


@pytest.mark.parametrize("fmt", K_PANEL_FORMATS)
def test_k_quant_panels_hold_ggufs_weights(fmt: str) -> None:
    # Per group its scales as fp32 beside the codes: more bytes, the same dequantized weights
    # (gguf-py's), and no way back to the super-blocks.
    weight = random_blocks(fmt, 48, in_features_of(fmt, 3), seed=13)
    panels = to_panels(weight)
    assert panels.layout == "panels" and panels.code == weight.code + 100
    per_group = {"Q4_K": 24, "Q6_K": 40}[fmt]
    assert panels.data.shape == (48, weight.in_features // 32 * per_group)
    assert torch.equal(panels.dequantize(), weight.dequantize())
    with pytest.raises(ValueError, match="GGUF's rows"):
        to_rows(panels)


@pytest.mark.parametrize("fmt", PANEL_FORMATS)
def test_panels_are_the_same_bytes_reordered(fmt: str) -> None:
    weight = random_blocks(fmt, 48, in_features_of(fmt, 3), seed=13)
    panels = to_panels(weight)
    assert panels.data.shape == weight.data.shape and not torch.equal(panels.data, weight.data)
    assert torch.equal(panels.data.flatten().sort().values, weight.data.flatten().sort().values)
    assert torch.equal(to_rows(panels).data, weight.data)
    assert torch.equal(panels.dequantize(), weight.dequantize())
    # the first group of rows 0..15: each head field of the 16 rows side by side (the scales
    # first), then code byte 0 of each
    block_bytes = BLOCK_FORMATS[fmt][2]
    first, start = weight.data[:16, :block_bytes], 0
    for width in PANEL_FORMATS[fmt]:
        field = panels.data.flatten()[16 * start : 16 * (start + width)]
        assert torch.equal(field, first[:, start : start + width].flatten())
        start += width
    assert torch.equal(panels.data.flatten()[16 * start : 16 * start + 16], first[:, start])


def test_rows_that_are_not_whole_panels_keep_ggufs_order() -> None:
    weight = random_blocks("Q4_1", 40, 64, seed=14)
    assert to_panels(weight) is weight


def test_bias_is_added(library) -> None:
    weight = random_blocks("Q4_0", 9, 64, seed=6)
    bias = randn(9, seed=7)
    x = randn(2, 64, seed=8)
    out = BlockLinear(weight, bias, library)(x)
    assert_close_to_reference(out - bias, x, weight.dequantize())


def test_q8_0_quantization_is_llama_cpps() -> None:
    """quantize_q8_0 against the format's definition: per 32 weights, scale = max|w| / 127
    stored in fp16 and codes round(w / scale) (with the unrounded scale), so each weight is
    within half a step of its value plus 127 codes times the scale's fp16 rounding (2^-11)."""
    weight = randn(6, 96, seed=9)
    blocks = quantize_q8_0(weight)
    assert blocks.format == "Q8_0" and tuple(blocks.data.shape) == (6, 3 * 34)
    groups = weight.view(6, 3, 32)
    scales = (groups.abs().amax(-1) / 127).half().float()
    stored = blocks.data.view(6, 3, 34)[:, :, :2].contiguous().view(torch.float16).float()
    assert torch.equal(stored.view(6, 3), scales)
    error = (blocks.dequantize().view(6, 3, 32) - groups).abs()
    assert (error <= scales[..., None] * (0.5 + 127 * 2**-11)).all()


def quantize_q5_0(weight: torch.Tensor) -> BlockWeight:
    """Q5_0 blocks of an fp32 [out, in] weight, written from the format's definition (llama.cpp's
    reference quantizer, in fp32): per 32 weights d = -p / 16 for p the weight of largest
    magnitude, codes q = min(31, trunc(w / d + 16.5)) whose value is d (q - 16). 22 bytes a
    block: fp16 d; the codes' fifth bits as a little-endian uint32, bit k weight k's; 16 bytes,
    byte j holding weight j's low four bits and weight j + 16's in its high four."""
    groups = weight.detach().float().numpy().reshape(weight.shape[0], -1, 32)
    peak = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)
    d = peak / np.float32(-16)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(31, np.trunc(groups * inverse + np.float32(16.5))).astype(np.uint32)
    fifth = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    nibbles = ((q[..., :16] & 15) | (q[..., 16:] & 15) << 4).astype(np.uint8)
    fields = [d.astype(np.float16).view(np.uint8), fifth[..., None].astype("<u4").view(np.uint8)]
    blocks = np.concatenate([*fields, nibbles], axis=-1).reshape(weight.shape[0], -1)
    return BlockWeight("Q5_0", torch.from_numpy(blocks), weight.shape[1])


def test_q5_0_as_gguf_reads_it_is_the_formats_definition() -> None:
    """The reference quantizer's blocks are gguf-py's, byte for byte, and gguf-py dequantizes
    them to within half a step of each weight (one step where the top code clips), plus 16
    codes times d's fp16 rounding (2^-11): the layout the kernels read is the file's."""
    weight = randn(6, 96, seed=17)
    blocks = quantize_q5_0(weight)
    assert tuple(blocks.data.shape) == (6, 3 * 22)
    ggufs = quantize(weight.numpy(), GGMLQuantizationType.Q5_0)
    assert np.array_equal(blocks.data.numpy(), ggufs)
    groups = weight.view(6, 3, 32)
    d = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)) / -16
    steps = torch.where(groups / d >= 15.5, 1.0, 0.5)  # w / d in [-16, 16]; 31 is the top code
    error = (blocks.dequantize().view(6, 3, 32) - groups).abs()
    assert (error <= d.abs() * (steps + 16 * 2**-11)).all()


@pytest.mark.parametrize("layout", ["rows", "panels"])
def test_q5_0_blocks_of_the_reference_quantizer_match_f_linear(library, layout: str) -> None:
    # Gemma 3 270M's widths: 640 (20 groups) into 48 outputs (three panels), and 2048 into 16
    for out_features, in_features in [(48, 640), (16, 2048)]:
        blocks = quantize_q5_0(randn(out_features, in_features, seed=in_features) * 0.05)
        layer = BlockLinear(laid_out(blocks, layout), None, library)
        x = randn(8, in_features, seed=out_features)
        out = layer(x)
        assert_close_to_reference(out, x, blocks.dequantize())
        assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(8)]))


def test_block_weights_refuse_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError):
        BlockWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 128)
    with pytest.raises(ValueError):
        BlockWeight("Q8_0", torch.zeros(2, 33, dtype=torch.uint8), 32)


def test_format_runs_and_parts_compute_a_fused_projection_of_mixed_formats(library) -> None:
    """Gemma 3's q and k in Q5_0 beside v in Q8_0: the rows fall into one run a format (adjacent
    parts of one format joined), and BlockLinearParts gives each run's own columns: F.linear on
    the dequantized rows, each part bit for bit as its BlockLinear alone."""
    q, k = random_blocks("Q5_0", 32, 64, seed=20), random_blocks("Q5_0", 16, 64, seed=21)
    v = random_blocks("Q8_0", 16, 64, seed=22)
    runs = format_runs([q, k, v])
    assert [(run.format, run.out_features) for run in runs] == [("Q5_0", 48), ("Q8_0", 16)]
    assert format_runs([q, random_blocks("Q8_0", 16, 96, seed=23)]) is None  # rows differ
    three = format_runs([q, v, k])  # a format between two runs of another
    assert [(run.format, run.out_features) for run in three] == [
        ("Q5_0", 32), ("Q8_0", 16), ("Q5_0", 16)
    ]  # fmt: skip
    parts = [BlockLinear(to_panels(run), None, library) for run in runs]
    fused = BlockLinearParts(parts)
    assert (fused.in_features, fused.out_features) == (64, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    got = fused(x)
    assert torch.equal(got, torch.cat([part(x) for part in parts], dim=-1))
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    torch.testing.assert_close(got, F.linear(x, dense), atol=1e-4, rtol=1e-4)


def test_concat_rows_stacks_parts_of_one_format_only() -> None:
    q, k = random_blocks("Q4_1", 4, 64, seed=10), random_blocks("Q4_1", 2, 64, seed=11)
    fused = concat_rows([q, k])
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    assert concat_rows([q, random_blocks("Q8_0", 2, 64, seed=12)]) is None
