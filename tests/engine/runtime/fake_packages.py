"""A fake packaged model for tests: a module on sys.path whose GGUF comes in chunk files,
with the interface of the real chunked packages (EXPECTED_SHA256, verify_chunks, assemble)."""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path

import pytest

from engine.runtime.model_packages import PackagedModel

CHUNKS = (b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3)
GGUF_BYTES = b"".join(CHUNKS)

_MODULE = """\
from hashlib import sha256
from pathlib import Path

EXPECTED_SHA256 = "{sha256}"
MODEL_NAME = "fake.gguf"
CALLS = []  # the paths assemble() was asked to write
_DATA = Path(__file__).parent / "data"


def chunk_paths():
    return [_DATA / "fake.gguf.part00", _DATA / "fake.gguf.part01"]


def verify_chunks():
    missing = [str(path) for path in chunk_paths() if not path.exists()]
    if missing:
        raise FileNotFoundError("Missing chunk files: " + ", ".join(missing))


def assemble(output_path):
    # As the real package does: writes in place, checks after, leaves a bad file behind.
    CALLS.append(Path(output_path))
    verify_chunks()
    target = Path(output_path)
    with target.open("wb") as out_file:
        for chunk in chunk_paths():
            out_file.write(chunk.read_bytes())
    if sha256(target.read_bytes()).hexdigest() != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    return target
"""


def install_fake_package(root: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> PackagedModel:
    """Write a fake chunked package under root, put root on sys.path; its table entry."""
    module = f"fake_model_{uuid.uuid4().hex[:8]}"  # unique: sys.modules keeps it after the test
    folder = root / module
    (folder / "data").mkdir(parents=True)
    sha256 = hashlib.sha256(GGUF_BYTES).hexdigest()
    (folder / "__init__.py").write_text(_MODULE.format(sha256=sha256))
    for index, chunk in enumerate(CHUNKS):
        (folder / "data" / f"fake.gguf.part0{index}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(root))
    return PackagedModel(
        name=name,
        packages=(f"{module}-main", f"{module}-part1"),
        module=module,
        gguf_file="fake.gguf",
        assembled_sha256=sha256,
    )


def assemble_calls(model: PackagedModel) -> list[Path]:
    return sys.modules[model.module].CALLS if model.module in sys.modules else []
