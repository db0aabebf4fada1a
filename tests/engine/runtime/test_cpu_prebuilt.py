"""Prebuilt native kernels: built where a compiler is (an image's build stage), loaded where none
is (the runtime image). The build here uses the real g++; "no compiler" is a PATH without one."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from engine.runtime.attention.cpu_native import CpuNativeBackend
from engine.runtime.attention.select import get_attention_backend
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu import capabilities, native
from engine.runtime.cpu.fused import CpuFusedOps
from engine.runtime.models.llama import RMSNorm

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the prebuilt levels are x86-64's"),
]

CPU = torch.device("cpu")
# An AVX2-only CPU's /proc/cpuinfo flags (x86-64-v3, no AVX-512).
AVX2_FLAGS = frozenset(
    {"sse4_2", "popcnt", "ssse3", "sse4_1", "cx16", "lahf_lm"}
    | {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
)
LEVELS_HERE = capabilities.levels_run_here(native.PREBUILT_LEVELS)  # best first


@pytest.fixture(scope="module")
def prebuilt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("prebuilt")
    native.build_prebuilt(directory)  # every level: a build host need not run what it builds
    return directory


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv(native.PREBUILT_ENV, raising=False)  # each test sets its own
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no g++ and no c++ on it
    native._load_library.cache_clear()
    yield
    native._load_library.cache_clear()


def library_name(library) -> str:
    return Path(library._name).name


def test_build_writes_one_library_per_level_and_drops_older_ones(
    prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = sorted(path.name for path in prebuilt_dir.iterdir())
    assert names == sorted(native.prebuilt_name(level) for level in native.PREBUILT_LEVELS)
    stale = prebuilt_dir / "prebuilt-avx2-0123456789abcdef.so"  # an older source's
    stale.write_bytes(b"an older revision")
    built = []  # the rebuild itself is the fixture's, already checked: not compiled again
    monkeypatch.setattr(native, "_compile", lambda compiler, level, target: built.append(level))
    native.build_prebuilt(prebuilt_dir, ("avx2",))
    assert built == ["avx2"]
    assert not stale.exists()
    assert sorted(path.name for path in prebuilt_dir.iterdir()) == names


@pytest.mark.skipif(not LEVELS_HERE, reason="no portable x86-64 level runs on this CPU")
@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_the_best_level_here_is_loaded_and_computes(
    prebuilt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt_dir))
    build_dir = tmp_path / "kernels"
    library = native.load_library(build_dir, "native")
    assert library_name(library) == native.prebuilt_name(LEVELS_HERE[0])
    assert not build_dir.exists()  # nothing was compiled
    norm = RMSNorm(96, 1e-5, CPU, torch.float32)
    norm.weight.data = torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3
    out = CpuFusedOps(library).rms_norm(x, norm.weight.data, norm.eps)
    torch.testing.assert_close(out, norm(x), atol=1e-5, rtol=1e-5)
    assert isinstance(get_attention_backend("auto", CPU, build_dir), CpuNativeBackend)


@pytest.mark.skipif(not LEVELS_HERE, reason="no portable x86-64 level runs on this CPU")
@pytest.mark.usefixtures("no_compiler")
def test_a_forced_level_loads_exactly_its_prebuilt(
    prebuilt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt_dir))
    lowest = LEVELS_HERE[-1]
    forced = capabilities.probe(environ={capabilities.ISA_ENV: lowest})
    monkeypatch.setattr(capabilities, "cpu_capabilities", lambda: forced)
    library = native.load_library(tmp_path)  # no level given: the probe's, forced
    assert library_name(library) == native.prebuilt_name(lowest)


@pytest.mark.usefixtures("no_compiler")
def test_an_avx2_cpu_skips_the_avx512_build_and_a_missing_best_level_falls_to_the_next(
    prebuilt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an AVX2-only CPU (or an image missing its best build) gets, on either kind of CPU:
    the avx2 library runs on both."""
    if "avx2" not in LEVELS_HERE:
        pytest.skip("this CPU does not run the avx2 build")
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt_dir))
    avx2_cpu = capabilities.probe(environ={}, flags=AVX2_FLAGS, bf16_supported=False)
    assert avx2_cpu.isa == "avx2"
    monkeypatch.setattr(capabilities, "cpu_capabilities", lambda: avx2_cpu)
    assert library_name(native.load_library(tmp_path)) == native.prebuilt_name("avx2")
    # This CPU's own best level, its file missing: the next level down is loaded.
    monkeypatch.setattr(capabilities, "cpu_capabilities", capabilities.probe)
    partial = tmp_path / "partial"
    shutil.copytree(prebuilt_dir, partial)
    (partial / native.prebuilt_name(LEVELS_HERE[0])).unlink()
    monkeypatch.setenv(native.PREBUILT_ENV, str(partial))
    native._load_library.cache_clear()
    next_level = LEVELS_HERE[1]  # avx2 runs here, so at least baseline is below the best
    assert library_name(native.load_library(tmp_path)) == native.prebuilt_name(next_level)


@pytest.mark.usefixtures("no_compiler")
def test_no_matching_prebuilt_is_an_error_and_auto_falls_back_to_torch(
    prebuilt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(native.NativeBuildError, match=native.PREBUILT_ENV):
        native.load_library(tmp_path)  # the variable is not set
    # A directory holding only another source revision's libraries (same bytes, older name).
    other = tmp_path / "other-revision"
    other.mkdir()
    for path in prebuilt_dir.iterdir():
        shutil.copy(path, other / path.name.replace("prebuilt-", "prebuilt-old-"))
    monkeypatch.setenv(native.PREBUILT_ENV, str(other))
    native._load_library.cache_clear()
    with pytest.raises(native.NativeBuildError, match="no prebuilt kernel library") as raised:
        native.load_library(tmp_path)
    assert str(other) in str(raised.value)
    assert "another revision of the sources" in str(raised.value)
    assert isinstance(get_attention_backend("auto", CPU, tmp_path), TorchRefBackend)


def test_only_portable_levels_are_prebuilt(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="native"):
        native.build_prebuilt(tmp_path, ("native",))  # valid on the build host only
    with pytest.raises(ValueError, match="got \\[\\]"):
        native.build_prebuilt(tmp_path, ())
    assert list(tmp_path.iterdir()) == []
