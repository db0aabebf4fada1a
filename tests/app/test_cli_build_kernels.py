"""`kvshare build-kernels DIR`: the prebuilt kernel libraries a host without a compiler loads
(tests/engine/runtime/test_cpu_prebuilt.py checks the loading)."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from app import cli
from engine.runtime.cpu import native


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the prebuilt levels are x86-64's")
def test_builds_the_levels_asked_and_prints_their_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["build-kernels", str(tmp_path), "--levels", "baseline"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / native.prebuilt_name("baseline"))]
    assert Path(printed[0]).is_file()


def test_an_unknown_level_is_an_error_naming_the_levels(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["build-kernels", str(tmp_path), "--levels", "avx2,avx9"]) == 1
    error = capsys.readouterr().err
    assert "avx9" in error and "avx512" in error
    assert not tmp_path.joinpath(native.prebuilt_name("avx2")).exists()  # checked before building


def test_no_level_is_an_error_and_the_default_is_every_prebuilt_level(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["build-kernels", str(tmp_path), "--levels", ","]) == 1
    assert "prebuilt levels must be among" in capsys.readouterr().err
    default = cli.build_parser().parse_args(["build-kernels", str(tmp_path)]).levels
    assert tuple(default.split(",")) == native.PREBUILT_LEVELS
