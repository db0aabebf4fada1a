"""The native CPU kernel library: kernels.cpp compiled once per machine, loaded with ctypes.

engine/runtime/cpu/kernels.cpp holds the paged decode attention of the cpu attention backend
(engine/runtime/attention/cpu_native.py) and the Llama block's fused RMSNorm (alone or after the
residual add), SiLU-and-mul, rope (alone or with the KV store) and few-row LM head
(engine/runtime/cpu/fused.py). It is compiled on first use with the system C++ compiler
(OpenMP) into a build dir (kernels/ in the kvshare cache dir), keyed by a hash of the source,
the flags and the compiler, then loaded with ctypes.

The ISA level picks the target (engine/runtime/cpu/capabilities.py says which run here):
"native" (-march=native, the default; its key also holds this CPU's flags, as its code is only
valid on the same CPU), or a forced portable level: "avx512" (-march=x86-64-v4: AVX-512 F, BW,
CD, DQ, VL), "avx2" (-march=x86-64-v3: AVX2 and FMA) or "baseline" (-march=x86-64-v2:
SSE4.2). One source serves them all: its vectors have 16 floats, one GCC vector extension with
AVX-512 and a struct of two (AVX2) or four (SSE) register-wide ones below it (vectors.h).

Where no compiler is installed (the runtime container image), libraries built ahead of time are
loaded instead: `kvshare build-kernels DIR` compiles the portable levels into DIR, and with
KVSHARE_PREBUILT_KERNELS=DIR a process without a compiler loads the best of them that this CPU
runs (the forced level, if one is).
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

# kernels.cpp: attention and the fused elementwise ops; block_kernels.cpp: linears on GGUF blocks;
# decode_step.cpp: a decode step's layer stack calling both.
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("kernels.cpp", "block_kernels.cpp", "decode_step.cpp")
)
HEADERS = (Path(__file__).with_name("vectors.h"),)  # included by both: part of the build key
# -Wno-psabi: 64-byte vectors below AVX-512 change a calling convention, but only between the
# source's own inlined helpers, never across the library's C entry points.
BASE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-Wno-psabi")
MARCH = {
    "native": "-march=native",
    "avx512": "-march=x86-64-v4",
    "avx2": "-march=x86-64-v3",
    "baseline": "-march=x86-64-v2",
}
# The levels a library can be built for on another machine (an image's build stage), best first:
# -march=native code is valid only on the CPU that compiled it.
PREBUILT_LEVELS = capabilities.FORCED_LEVELS
PREBUILT_ENV = "KVSHARE_PREBUILT_KERNELS"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype argument
# A KV cache's dtype code (paged decode and rope-store take one beside the activations'): the
# activations' own, or float16 / bfloat16 under float32 activations (kernels.cpp
# with_cache_dtype).
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cache_dtype_code(dtype: torch.dtype, cache_dtype: torch.dtype) -> int | None:
    """The cache's code when the kernels take (dtype, cache_dtype); None when they do not."""
    if dtype not in DTYPE_CODES or cache_dtype not in CACHE_DTYPE_CODES:
        return None
    if cache_dtype != dtype and dtype != torch.float32:
        return None
    return CACHE_DTYPE_CODES[cache_dtype]


class NativeBuildError(RuntimeError):
    """The kernel library could not be compiled or loaded; the message says why."""


def compile_flags(isa: str) -> tuple[str, ...]:
    """The compiler flags of one ISA level (a key of MARCH)."""
    flags = (*BASE_FLAGS, MARCH[isa])
    if isa in ("native", "avx512") and platform.machine() in ("x86_64", "AMD64"):
        # GCC's default tuning splits 512-bit vectors on some x86 CPUs (Zen 4); ask for whole ones.
        flags += ("-mprefer-vector-width=512",)
    return flags


def load_library(build_dir: Path, isa: str | None = None) -> ctypes.CDLL:
    """The kernel library built for `isa` (a key of MARCH; default: the probe's kernel_isa,
    native unless KVSHARE_CPU_ISA forces lower), built once and cached on disk and in this
    process; without a compiler, a prebuilt one (see the module docstring). Raises
    NativeBuildError."""
    level = capabilities.cpu_capabilities().kernel_isa if isa is None else isa
    if level not in MARCH:
        raise ValueError(f"ISA level must be one of {tuple(MARCH)}, got {level!r}")
    return _load_library(build_dir, level)


@cache
def _load_library(build_dir: Path, isa: str) -> ctypes.CDLL:
    compiler = _find_compiler()
    if compiler is None:
        return _load_prebuilt(isa)
    try:
        target = build_dir / f"kernels-{isa}-{_build_key(compiler, isa)}.so"
        if not target.is_file():
            _compile(compiler, isa, target)
            _remove_other_builds(target, f"kernels-{isa}-*.so", "cpu_kernels-*.so")
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable dir, bad CXX, bad .so
        raise NativeBuildError(f"cannot build or load the kernel with {compiler!r}: {exc}") from exc
    _declare(library)
    return library


def build_prebuilt(directory: Path, levels: tuple[str, ...] = PREBUILT_LEVELS) -> list[Path]:
    """Compile `levels` into `directory` for hosts without a compiler (KVSHARE_PREBUILT_KERNELS);
    the builds of an older source there are removed. Returns the libraries' paths."""
    unknown = [level for level in levels if level not in PREBUILT_LEVELS]
    if unknown or not levels:
        raise ValueError(f"prebuilt levels must be among {PREBUILT_LEVELS}, got {list(levels)}")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeBuildError(f"prebuilt levels are x86-64 levels; this is {platform.machine()}")
    compiler = _find_compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (install g++ or set CXX)")
    targets = []
    for level in levels:
        target = directory / prebuilt_name(level)
        try:
            _compile(compiler, level, target)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeBuildError(f"cannot build the kernel with {compiler!r}: {exc}") from exc
        _remove_other_builds(target, f"prebuilt-{level}-*.so")
        targets.append(target)
    return targets


def prebuilt_name(level: str) -> str:
    """The file name of a prebuilt library: its level and a hash of the source and the flags
    (a library of another source revision is never loaded)."""
    digest = _sources_digest()
    digest.update(" ".join(compile_flags(level)).encode())
    return f"prebuilt-{level}-{digest.hexdigest()[:16]}.so"


def _find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _load_prebuilt(isa: str) -> ctypes.CDLL:
    """The best prebuilt library that runs here: for "native" the highest portable level this
    CPU executes, else exactly the forced level."""
    directory = os.environ.get(PREBUILT_ENV)
    levels = capabilities.levels_run_here(PREBUILT_LEVELS) if isa == "native" else (isa,)
    candidates = [Path(directory) / prebuilt_name(level) for level in levels] if directory else []
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        where = f"in {directory}" if directory else f"({PREBUILT_ENV} is empty or not set)"
        if directory and any(Path(directory).glob("prebuilt-*.so")):
            where += " (only libraries of another kernels.cpp revision: rebuild them)"
        raise NativeBuildError(
            "no C++ compiler found (install g++ or set CXX) and no prebuilt kernel library "
            f"for {' or '.join(levels) or 'this CPU'} {where}"
        )
    try:
        library = ctypes.CDLL(str(found))
    except OSError as exc:
        raise NativeBuildError(f"cannot load the prebuilt kernel {found}: {exc}") from exc
    _declare(library)
    logger.info("no C++ compiler here: using the prebuilt native CPU kernels %s", found)
    return library


def _build_key(compiler: str, isa: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = _sources_digest()
    digest.update(" ".join(compile_flags(isa)).encode())
    digest.update(version.encode())
    if isa == "native":  # -march=native code is only valid on the same CPU
        digest.update(" ".join(sorted(capabilities.cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _sources_digest():
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest


def _compile(compiler: str, isa: str, target: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """`sources` (default: this tree's) built for `isa` into target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent starts never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        paths = [str(source) for source in sources]
        command = [compiler, *compile_flags(isa), "-shared", "-fPIC", *paths, "-o", str(built)]
        logger.info("building the native CPU kernels: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            names = " ".join(source.name for source in sources)
            raise NativeBuildError(f"compiling {names} failed:\n{result.stderr[-2000:]}")
        built.replace(target)


def _remove_other_builds(target: Path, *patterns: str) -> None:
    """Drop the libraries of other sources or compilers that `patterns` match beside `target`
    (one level's): one build per source revision would pile up. A process still running an old
    one keeps its mapping (Linux unlinks lazily); the other levels' builds stay."""
    for pattern in patterns:
        for stale in target.parent.glob(pattern):
            if stale != target:
                stale.unlink(missing_ok=True)


def _declare(library: ctypes.CDLL) -> None:
    int_, ptr = ctypes.c_int, ctypes.c_void_p
    library.kvshare_paged_decode.restype = int_
    library.kvshare_paged_decode.argtypes = [
        int_, int_, *[ptr] * 6, *[int_] * 6, ctypes.c_float, int_
    ]  # fmt: skip
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
        int_, int_, ptr, long_, ptr, ptr, ptr, ptr, ptr, ptr, long_, int_, int_, int_, long_, int_
    ]  # fmt: skip
    library.kvshare_add_rms_norm.restype = int_
    library.kvshare_add_rms_norm.argtypes = [int_, ptr, ptr, ptr, ptr, long_, int_, float_, int_]
    library.kvshare_argmax.restype = int_
    library.kvshare_argmax.argtypes = [ptr, long_, long_, ptr]
    library.kvshare_gemv.restype = int_
    library.kvshare_gemv.argtypes = [int_, ptr, ptr, ptr, int_, int_, long_, int_]
    library.kvshare_block_linear.restype = int_
    library.kvshare_block_linear.argtypes = [int_, ptr, ptr, ptr, int_, int_, long_, int_]
    library.kvshare_block_linear_rows.restype = int_
    library.kvshare_block_linear_rows.argtypes = [int_, ptr, ptr, ptr, int_, int_, long_, int_, ptr]
    library.kvshare_panel_amx.restype = int_
    library.kvshare_panel_amx.argtypes = [int_]
    library.kvshare_block_rows.restype = int_
    library.kvshare_block_rows.argtypes = [int_, ptr, ptr, ptr, int_, int_]
    library.kvshare_greedy_head.restype = int_
    library.kvshare_greedy_head.argtypes = [
        int_, ptr, ptr, ptr, ptr, int_, int_, long_, int_, ptr
    ]  # fmt: skip
    library.kvshare_greedy_head_fast.restype = int_
    library.kvshare_greedy_head_fast.argtypes = []
    library.kvshare_decode_layers.restype = int_
    library.kvshare_decode_layers.argtypes = [*[ptr] * 13, long_, ptr, float_, float_, int_]
