"""The panel kernels on AMX tiles (engine/runtime/cpu/amx_panels.cpp):
on for prompt tokens where the CPU has them (KVSHARE_CPU_AMX=0 turns them off) and taken exactly
where the build and the CPU have them; on such a CPU, the tiles against F.linear on the
dequantized weights and the FMA path, at row counts that fill no tile, one, and several with a
remainder. The rest of the kernel suites (test_block_linear, test_greedy_head) run on the tiles
too, through kernel_paths()."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.runtime.cpu.block_linear import PANEL_FORMATS, BlockLinear, to_panels
from engine.runtime.cpu.capabilities import (
    _V3,
    _V4,
    AMX_ENV,
    ISA_ENV,
    available_isa_levels,
    probe,
)
from engine.runtime.cpu.native import load_library
from tests.engine.runtime.kernel_paths import AMX, AMX_FLAGS, AMX_LEVELS, amx_here, kernel_path
from tests.engine.runtime.test_block_linear import (
    assert_close_to_reference,
    in_features_of,
    randn,
    random_blocks,
)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

HAS_AMX = amx_here()
AMX_PATHS = [level + AMX for level in available_isa_levels() if HAS_AMX and level in AMX_LEVELS]


@pytest.mark.parametrize(
    ("value", "flags", "expected"),
    [
        ("", _V4 | AMX_FLAGS, True),  # on where the CPU has them
        ("1", _V4 | AMX_FLAGS, True),
        ("0", _V4 | AMX_FLAGS, False),
        ("off", _V4 | AMX_FLAGS, False),
        ("", _V4 | {"amx_tile"}, False),  # tiles without bf16 products
        ("", _V4, False),
        ("", _V3 | AMX_FLAGS, False),  # no AVX-512 build to carry the tile code
    ],
)
def test_the_probe_says_amx_on_a_cpu_with_it_unless_turned_off(
    value: str, flags: frozenset[str], expected: bool
) -> None:
    environ = {AMX_ENV: value} if value else {}
    assert probe(environ, frozenset(flags), bf16_supported=True).amx is expected


def test_a_forced_level_below_avx512_has_no_tiles() -> None:
    flags = frozenset(_V4 | AMX_FLAGS)
    assert probe({ISA_ENV: "avx512"}, flags, bf16_supported=True).amx
    for level in ("avx2", "baseline"):
        assert not probe({ISA_ENV: level}, flags, bf16_supported=True).amx, level


def test_the_tiles_are_taken_exactly_where_the_build_and_the_cpu_have_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for level in available_isa_levels():
        library = load_library(tmp_path_factory.getbasetemp() / "native-kernels", level)
        before = library.kvshare_panel_amx(-1)
        try:
            expected = HAS_AMX and level in AMX_LEVELS
            assert bool(library.kvshare_panel_amx(1)) == expected, level
            assert library.kvshare_panel_amx(0) == 0
        finally:
            library.kvshare_panel_amx(before)


@pytest.fixture(scope="module", params=AMX_PATHS)
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    with kernel_path(tmp_path_factory.getbasetemp() / "native-kernels", request.param) as library:
        yield library


@pytest.mark.parametrize("fmt", PANEL_FORMATS)
@pytest.mark.parametrize(("out_features", "groups"), [(16, 1), (80, 18), (96, 7), (112, 48)])
def test_tiles_match_f_linear_and_give_each_row_its_bits_alone(
    library, fmt: str, out_features: int, groups: int
) -> None:
    # 1 and 3 rows fill part of a tile, 16 one, 40 two and a remainder of 8: each row's bits are
    # the ones it gets alone
    weight = random_blocks(fmt, out_features, in_features_of(fmt, groups), seed=groups)
    layer = BlockLinear(to_panels(weight), None, library)
    x = randn(40, weight.in_features, seed=out_features)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    assert_close_to_reference(alone, x, weight.dequantize())
    for rows in (3, 16, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_the_tiles_and_the_fmas_differ_only_in_summation_order(library) -> None:
    weight = random_blocks("Q4_1", 64, in_features_of("Q4_1", 18), seed=7)
    layer = BlockLinear(to_panels(weight), None, library)
    x = randn(20, weight.in_features, seed=8)
    tiles = layer(x)
    library.kvshare_panel_amx(0)
    try:
        fmas = layer(x)
    finally:
        library.kvshare_panel_amx(1)
    for out in (tiles, fmas):
        assert_close_to_reference(out, x, weight.dequantize())
    assert not torch.equal(tiles, fmas)  # the switch took another path
