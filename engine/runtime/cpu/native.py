"""The native CPU kernel library: the C++ sources of engine/runtime/cpu compiled once per machine
into one library, loaded with ctypes.

The sources: paged_attention.cpp, the paged decode attention of the cpu attention backend
(engine/runtime/attention/cpu_native.py); fused_ops.cpp, the Llama block's fused RMSNorm (alone
or after the residual add), SiLU-and-mul, rope (alone or with the KV store) and few-row LM head
(engine/runtime/cpu/fused.py); the linears on GGUF blocks (block_linear.cpp, picking among
block_tiles.cpp, fma_panels.cpp, amx_panels.cpp and, for prompt rows without AMX tiles,
prefill_gemm.cpp; engine/runtime/cpu/block_linear.py); greedy_head.cpp, the greedy token without
the whole LM head; decode_step.cpp, a step's layer stack calling the others
(engine/runtime/cpu/decode_step.py). kvshare_native.h declares every entry point and the codes
they take: each source includes it, and the ctypes bindings and the codes here are read from it
(read_header), so neither is written twice.

The library is compiled on first use with the system C++ compiler (OpenMP) into a build dir
(kernels/ in the kvshare cache dir), keyed by a hash of the sources and headers, the flags and
the compiler, then loaded with ctypes.

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
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from engine.runtime.cpu import capabilities

logger = logging.getLogger(__name__)

# Every source of this folder is built into the one library; the headers they include are part
# of the build key.
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
INTERFACE_HEADER = Path(__file__).with_name("kvshare_native.h")
# -Wno-psabi: 64-byte vectors below AVX-512 change a calling convention, but only between the
# source's own inlined helpers, never across the library's C entry points.
# -Werror=missing-declarations: a function other sources can call (an entry point above all)
# must be declared in a header first, so none is defined without its prototype.
BASE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-Wno-psabi", "-Werror=missing-declarations")
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


@dataclass(frozen=True)
class Prototype:
    """One entry point as kvshare_native.h declares it, in ctypes' terms."""

    name: str
    restype: type
    argtypes: tuple[type, ...]


@dataclass(frozen=True)
class Interface:
    """What kvshare_native.h declares: its integer constants and its entry points, by name."""

    constants: dict[str, int]
    prototypes: dict[str, Prototype]


# The header's parameter and return types. A pointer of any type is an address (c_void_p): the
# callers pass a tensor's data_ptr() or None.
_SCALAR_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_CONSTANT = re.compile(r"constexpr\s+int\s+(k\w+)\s*=\s*(-?\d+)\s*;")
_PROTOTYPE = re.compile(r"(\w+)\s+(kvshare_\w+)\s*\(([^()]*)\)", re.S)
_PARAMETER = re.compile(r"(?:const\s+)?(\w+)\s*((?:\*\s*(?:const\b\s*)?)*)\b(\w+)")


def read_header(text: str) -> Interface:
    """The constants and prototypes of a header in kvshare_native.h's forms (its preamble says
    which). Raises ValueError naming what it cannot read: a header written otherwise fails here,
    never binds a wrong type."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    constants = {name: int(value) for name, value in _CONSTANT.findall(code)}
    if code.count("constexpr") != len(_CONSTANT.findall(code)):
        raise ValueError("a constexpr in the header is not `constexpr int kName = <integer>;`")
    blocks = re.findall(r'extern\s+"C"\s*\{([^{}]*)\}', code)
    if len(blocks) != 1 or code.count('extern "C"') != 1:
        raise ValueError('the header must hold one extern "C" block of prototypes only')
    prototypes: dict[str, Prototype] = {}
    for declaration in filter(None, (part.strip() for part in blocks[0].split(";"))):
        prototype = _prototype(" ".join(declaration.split()))
        if prototype.name in prototypes:
            raise ValueError(f"{prototype.name} is declared twice")
        prototypes[prototype.name] = prototype
    return Interface(constants, prototypes)


def _prototype(declaration: str) -> Prototype:
    match = _PROTOTYPE.fullmatch(declaration)
    if match is None or match.group(1) not in _SCALAR_TYPES:
        raise ValueError(f"not a prototype returning int, int64_t or float: {declaration!r}")
    restype, name, parameters = match.groups()
    argtypes = []
    for parameter in parameters.split(",") if parameters.strip() not in ("", "void") else ():
        found = _PARAMETER.fullmatch(parameter.strip())
        if found is None or not (found.group(2) or found.group(1) in _SCALAR_TYPES):
            raise ValueError(f"{name}: cannot bind the parameter {parameter.strip()!r}")
        argtypes.append(ctypes.c_void_p if found.group(2) else _SCALAR_TYPES[found.group(1)])
    return Prototype(name, _SCALAR_TYPES[restype], tuple(argtypes))


INTERFACE = read_header(INTERFACE_HEADER.read_text())
_CODES = INTERFACE.constants
DTYPE_CODES = {torch.float32: _CODES["kFloat32"], torch.bfloat16: _CODES["kBfloat16"]}
# A KV cache's dtype code (paged decode and rope-store take one beside the activations'): the
# activations' own, or float16 / bfloat16 under float32 activations.
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.float16: _CODES["kFloat16"]}


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
            where += " (only libraries of another revision of the sources: rebuild them)"
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
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest


def _compile(
    compiler: str,
    isa: str,
    target: Path,
    sources: tuple[Path, ...] = SOURCES,
    extra_flags: tuple[str, ...] = (),
) -> None:
    """`sources` (default: this tree's) built for `isa` into target; `extra_flags` after the
    level's own (benchmarks/ab.py relaxes a check for the sources of another tree)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent starts never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        flags = [*compile_flags(isa), *extra_flags, "-fPIC"]
        logger.info("building the native CPU kernels for %s: %s", isa, " ".join(flags))
        # One compiler per source, as many at once as there are cores (the largest first: it
        # takes longest), then one link.
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        commands = [
            [compiler, *flags, "-c", str(source), "-o", str(obj)]
            for source, obj in sorted(
                zip(sources, objects, strict=True), key=lambda pair: -pair[0].stat().st_size
            )
        ]
        with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
            results = list(pool.map(_run_compiler, commands))
        link = [compiler, *flags, "-shared", *map(str, objects), "-o", str(built)]
        results.append(_run_compiler(link))
        failed = next((result for result in results if result.returncode != 0), None)
        if failed is not None:
            names = " ".join(source.name for source in sources)
            raise NativeBuildError(f"compiling {names} failed:\n{failed.stderr[-2000:]}")
        built.replace(target)


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _remove_other_builds(target: Path, *patterns: str) -> None:
    """Drop the libraries of other sources or compilers that `patterns` match beside `target`
    (one level's): one build per source revision would pile up. A process still running an old
    one keeps its mapping (Linux unlinks lazily); the other levels' builds stay."""
    for pattern in patterns:
        for stale in target.parent.glob(pattern):
            if stale != target:
                stale.unlink(missing_ok=True)


def _declare(library: ctypes.CDLL) -> None:
    """Every entry point's ctypes signature, as kvshare_native.h declares it."""
    for prototype in INTERFACE.prototypes.values():
        try:
            function = getattr(library, prototype.name)
        except AttributeError as exc:
            raise NativeBuildError(f"{library._name} lacks {prototype.name}: {exc}") from exc
        function.restype = prototype.restype
        function.argtypes = list(prototype.argtypes)
