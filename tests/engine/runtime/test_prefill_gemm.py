"""The prefill GEMM (engine/runtime/cpu/prefill_gemm.cpp) once per kernel build level this CPU
executes: against F.linear on the weights as gguf-py dequantizes them, every format in both
layouts, on odd shapes; batch invariance (a row's bits alone are its bits among 3, 8, 64 or 256
rows, anywhere among them, with 1 or 2 threads); and its place in kvshare_block_linear_rows,
where a prompt row (tile_rows 1) takes it unless the AMX tiles or, for the panel formats on an
AVX-512 build, the FMAs do (kvshare_prompt_path), and the probe's answer whether the runner
marks prompt rows."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.runtime.cpu.block_linear import FORMAT_NAMES, PANEL_FORMATS, BlockLinear, BlockWeight
from engine.runtime.cpu.capabilities import (
    _V3,
    _V4,
    AMX_ENV,
    ISA_ENV,
    PREFILL_GEMM_ENV,
    available_isa_levels,
    cpu_flags,
    probe,
)
from engine.runtime.cpu.native import INTERFACE, load_library
from tests.engine.runtime.kernel_paths import AMX_FLAGS, AMX_LEVELS, amx_here
from tests.engine.runtime.test_block_linear import (
    LAYOUTS,
    assert_close_to_reference,
    in_features_of,
    laid_out,
    randn,
    random_blocks,
    rows_for,
)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
PROMPT = INTERFACE.constants  # kPanelCode and a prompt row's path codes


@pytest.fixture(scope="module", params=available_isa_levels())
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # The session's build dir, shared with the other native kernel tests: one build per level.
    library = load_library(tmp_path_factory.getbasetemp() / "native-kernels", request.param)
    library.level = request.param
    return library


def prefill_gemm(library, weight: BlockWeight, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    # x: [N, in_features] -> [N, out_features]
    out = torch.full((x.shape[0], weight.out_features), float("nan"))
    status = library.kvshare_prefill_gemm(
        weight.code, x.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0],
        weight.in_features, weight.out_features, threads,
    )  # fmt: skip
    assert status == 0, status
    return out


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
@pytest.mark.parametrize(("out_features", "blocks_per_row"), [(1, 1), (13, 2), (50, 7), (80, 18)])
def test_matches_f_linear_on_the_dequantized_weights(
    library, fmt: str, layout: str, out_features: int, blocks_per_row: int
) -> None:
    # 29 rows: whole row tiles and a remainder at every level (tiles of 12, 6 or 3 rows); the
    # columns: less than one block of columns, a part of one (13: rows only), several and a part
    out_features = rows_for(layout, out_features)
    weight = random_blocks(fmt, out_features, in_features_of(fmt, blocks_per_row), seed=3)
    x = randn(29, weight.in_features, seed=out_features)
    out = prefill_gemm(library, laid_out(weight, layout), x)
    assert_close_to_reference(out, x, weight.dequantize())


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_a_rows_bits_are_the_same_alone_and_among_3_8_64_or_256_rows(
    library, fmt: str, layout: str
) -> None:
    # 37 outputs (rows) or 48 (panels, three: a block of two and one left); K over several chunks
    weight = laid_out(
        random_blocks(fmt, 37 if layout == "rows" else 48, in_features_of(fmt, 9), seed=5), layout
    )
    x = randn(256, weight.in_features, seed=6)
    crowd = prefill_gemm(library, weight, x)
    for rows in (1, 3, 8, 64):
        assert torch.equal(prefill_gemm(library, weight, x[:rows]), crowd[:rows]), rows
    for row in (0, 5, 13, 100, 255):  # alone, wherever it sat in the crowd
        assert torch.equal(prefill_gemm(library, weight, x[row : row + 1]), crowd[row : row + 1])
    assert torch.equal(prefill_gemm(library, weight, x[97:105]), crowd[97:105])
    assert torch.equal(prefill_gemm(library, weight, x, threads=1), crowd)


def test_shapes_and_formats_it_does_not_take_are_refused(library) -> None:
    out, x = torch.empty(16, 16), torch.zeros(16, 64)
    cases = [
        (7, 64, 16, 1),  # no kernel for format 7
        (2, 48, 16, 2),  # Q4_0 rows of 48: not whole blocks
        (12, 128, 16, 2),  # Q4_K rows of 128: not whole super-blocks
        (102, 64, 8, 2),  # Q4_0 panels of 8 columns: not whole panels
        (114, 64, 8, 2),  # Q6_K panels (per group) of 8 columns
    ]
    for fmt, in_features, out_features, status in cases:
        got = library.kvshare_prefill_gemm(
            fmt, x.data_ptr(), x.data_ptr(), out.data_ptr(), 1, in_features, out_features, 2
        )
        assert got == status, (fmt, in_features, out_features)


def expected_prompt_path(library, code: int) -> int:
    """kvshare_prompt_path's rule: the tiles for a panel format they compute (not the
    K-quants') where this process has them, the FMAs for a panel format on an AVX-512 build,
    else the prefill GEMM."""
    panels = code > PROMPT["kPanelCode"]
    tiles = panels and FORMAT_NAMES[code - PROMPT["kPanelCode"]] in PANEL_FORMATS
    if tiles and amx_here() and library.level in AMX_LEVELS:
        return PROMPT["kPromptTiles"]
    avx512 = library.level == "avx512" or (library.level == "native" and "avx512f" in cpu_flags())
    return PROMPT["kPromptFmas"] if panels and avx512 else PROMPT["kPromptGemm"]


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_a_prompt_rows_path_is_one_per_format_and_build(library, fmt: str, layout: str) -> None:
    code = laid_out(
        random_blocks(fmt, rows_for(layout, 16), in_features_of(fmt, 1), 1), layout
    ).code
    assert library.kvshare_prompt_path(code) == expected_prompt_path(library, code)


@pytest.mark.parametrize(("fmt", "layout"), LAYOUTS)
def test_block_linear_rows_runs_prompt_rows_on_their_path_and_the_rest_on_the_fmas(
    library, fmt: str, layout: str
) -> None:
    """tile_rows 1 (a prompt row): the bits of its path (kvshare_prompt_path), the prefill
    GEMM's or the FMAs'; tile_rows 0: the FMAs' (kvshare_block_linear, whose default path is
    the FMAs here), in runs of either kind; the GEMM gives other bits, so the routing shows."""
    weight = laid_out(
        random_blocks(fmt, rows_for(layout, 40), in_features_of(fmt, 5), seed=7), layout
    )
    path = library.kvshare_prompt_path(weight.code)
    if path == PROMPT["kPromptTiles"]:
        pytest.skip("panels' prompt rows take the AMX tiles here (test_block_linear.py)")
    layer = BlockLinear(weight, None, library)
    x = randn(90, weight.in_features, seed=8)
    paths = torch.zeros(90, dtype=torch.int32)
    paths[:3] = paths[5:6] = paths[20:84] = 1  # decode rows between and after prompt runs
    before = library.kvshare_panel_amx(0)
    try:
        fmas = layer(x)
    finally:
        library.kvshare_panel_amx(before)
    prompts = prefill_gemm(library, weight, x) if path == PROMPT["kPromptGemm"] else fmas
    assert torch.equal(prompts, fmas) == (path == PROMPT["kPromptFmas"])
    assert torch.equal(layer(x, paths), torch.where(paths[:, None].bool(), prompts, fmas))
    assert torch.equal(layer(x, torch.ones(90, dtype=torch.int32)), prompts)


@pytest.mark.parametrize(
    ("environ", "flags", "expected"),
    [
        ({}, _V4, True),  # the prefill GEMM
        ({}, _V3, True),
        ({PREFILL_GEMM_ENV: "0"}, _V4, False),
        ({}, _V4 | AMX_FLAGS, True),  # the tiles
        ({AMX_ENV: "0"}, _V4 | AMX_FLAGS, False),  # the kernels would take the tiles
        ({PREFILL_GEMM_ENV: "0"}, _V4 | AMX_FLAGS, True),
        ({ISA_ENV: "avx2"}, _V4 | AMX_FLAGS, True),  # no tile code: the prefill GEMM
        ({ISA_ENV: "avx2", PREFILL_GEMM_ENV: "off"}, _V4 | AMX_FLAGS, False),
    ],
)
def test_the_probe_marks_prompt_rows_unless_a_switch_keeps_them_on_the_fmas(
    environ: dict[str, str], flags: frozenset[str], expected: bool
) -> None:
    assert probe(environ, frozenset(flags), bf16_supported=True).prompt_rows is expected
