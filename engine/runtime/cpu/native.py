"""The native CPU kernel library: kernels.cpp compiled once per machine, loaded with ctypes.

engine/runtime/cpu/kernels.cpp holds the paged decode attention of the cpu attention backend
(engine/runtime/attention/cpu_native.py) and the Llama block's fused RMSNorm (alone or after the
residual add), SiLU-and-mul, rope (alone or with the KV store) and few-row LM head
(engine/runtime/cpu/fused.py). It is compiled on first use with the system C++ compiler
(OpenMP) into a build dir (kernels/ in the kvshare cache dir), keyed by a hash of the source,
the flags and the compiler, then loaded with ctypes.

The ISA level picks the target (engine/runtime/cpu/capabilities.py says which run here):
"native" (-march=native, the default; its key also holds this CPU's flags, as its code is only
valid on the same CPU), or a forced lower level: "avx2" (-march=x86-64-v3: AVX2 and FMA, no
AVX-512) or "baseline" (-march=x86-64-v2: SSE4.2). One source serves them all: its vectors are
GCC vector extensions of 16 floats, which the compiler splits into as many registers as the
level has.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine.runtime.cpu import capabilities

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# -Wno-psabi: 64-byte vectors below AVX-512 change a calling convention, but only between the
# source's own inlined helpers, never across the library's C entry points.
BASE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-Wno-psabi")
MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3", "baseline": "-march=x86-64-v2"}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype argument


class NativeBuildError(RuntimeError):
    """The kernel library could not be compiled or loaded; the message says why."""


def compile_flags(isa: str) -> tuple[str, ...]:
    """The compiler flags of one ISA level (a key of MARCH)."""
    flags = (*BASE_FLAGS, MARCH[isa])
    if isa == "native" and platform.machine() in ("x86_64", "AMD64"):
        # GCC's default tuning splits 512-bit vectors on some x86 CPUs (Zen 4); ask for whole ones.
        flags += ("-mprefer-vector-width=512",)
    return flags


def load_library(build_dir: Path, isa: str | None = None) -> ctypes.CDLL:
    """The kernel library built for `isa` ("native" | "avx2" | "baseline"; default: the probe's
    kernel_isa, native unless KVSHARE_CPU_ISA forces lower), built once and cached on disk and
    in this process. Raises NativeBuildError."""
    level = capabilities.cpu_capabilities().kernel_isa if isa is None else isa
    if level not in MARCH:
        raise ValueError(f"ISA level must be one of {tuple(MARCH)}, got {level!r}")
    return _load_library(build_dir, level)


@cache
def _load_library(build_dir: Path, isa: str) -> ctypes.CDLL:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (install g++ or set CXX)")
    try:
        target = build_dir / f"kernels-{isa}-{_build_key(compiler, isa)}.so"
        if not target.is_file():
            _compile(compiler, isa, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable dir, bad CXX, bad .so
        raise NativeBuildError(f"cannot build or load the kernel with {compiler!r}: {exc}") from exc
    _declare(library)
    return library


def _build_key(compiler: str, isa: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(compile_flags(isa)).encode())
    digest.update(version.encode())
    if isa == "native":  # -march=native code is only valid on the same CPU
        digest.update(" ".join(sorted(capabilities.cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, isa: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent starts never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *compile_flags(isa), "-shared", "-fPIC", str(SOURCE), "-o", str(built)]
        logger.info("building the native CPU kernels: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeBuildError(f"compiling {SOURCE.name} failed:\n{result.stderr[-2000:]}")
        built.replace(target)
    _remove_other_builds(isa, target)


def _remove_other_builds(isa: str, target: Path) -> None:
    """Drop this level's libraries of other sources or compilers: one build per source revision
    would pile up. A process still running an old one keeps its mapping (Linux unlinks lazily);
    the other levels' builds stay, each is valid on its own."""
    legacy = target.parent.glob("cpu_kernels-*.so")  # named before the level was in the name
    for stale in [*target.parent.glob(f"kernels-{isa}-*.so"), *legacy]:
        if stale != target:
            stale.unlink(missing_ok=True)


def _declare(library: ctypes.CDLL) -> None:
    int_, ptr = ctypes.c_int, ctypes.c_void_p
    library.kvshare_paged_decode.restype = int_
    library.kvshare_paged_decode.argtypes = [int_, *[ptr] * 6, *[int_] * 6, ctypes.c_float, int_]
    library.kvshare_supports_shape.restype = int_
    library.kvshare_supports_shape.argtypes = [int_, int_]
    long_, float_ = ctypes.c_int64, ctypes.c_float
    library.kvshare_rms_norm.restype = int_
    library.kvshare_rms_norm.argtypes = [int_, ptr, ptr, ptr, long_, int_, float_, int_]
    library.kvshare_silu_mul.restype = int_
    library.kvshare_silu_mul.argtypes = [int_, ptr, ptr, long_, int_, int_]
    library.kvshare_rope.restype = int_
    library.kvshare_rope.argtypes = [int_, ptr, long_, ptr, ptr, ptr, long_, int_, int_, int_]
    library.kvshare_rope_store.restype = int_
    library.kvshare_rope_store.argtypes = [
        int_, ptr, long_, ptr, ptr, ptr, ptr, ptr, ptr, long_, int_, int_, int_, long_, int_
    ]  # fmt: skip
    library.kvshare_add_rms_norm.restype = int_
    library.kvshare_add_rms_norm.argtypes = [int_, ptr, ptr, ptr, ptr, long_, int_, float_, int_]
    library.kvshare_gemv.restype = int_
    library.kvshare_gemv.argtypes = [int_, ptr, ptr, ptr, int_, int_, long_, int_]
