"""The CPU backend: the torch reference with decode attention in a native kernel.

Decode attention on the torch path gathers every sequence's blocks into a dense copy, then
runs SDPA under a padding mask: on this CPU that is most of a decode step's non-matmul
time. `cpu_kernels.cpp` reads K/V in place through the block tables instead. It is compiled
on first use with the system C++ compiler (-march=native, OpenMP) into the kvshare cache
dir, keyed by a hash of the source, the flags and the compiler, then loaded with ctypes.
Prefill chunks, KV stores and block copies stay on the torch path. The same library carries
the fused RMSNorm / SiLU-and-mul / rope that engine/runtime/cpu/fused.py wraps for the model.

No compiler, a failed build, or a shape/dtype the kernel does not cover (float16, head dims
other than 64/128, more than 8 query heads per KV head) all fall back to the torch path, so
results never depend on it.
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.attention.torch_ref import TorchRefBackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
if platform.machine() in ("x86_64", "AMD64"):
    # GCC's default tuning splits 512-bit vectors on some x86 CPUs (Zen 4); ask for whole ones.
    FLAGS += ("-mprefer-vector-width=512",)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype argument


class NativeBuildError(RuntimeError):
    """The kernel library could not be compiled or loaded; the message says why."""


@dataclass(frozen=True)
class _StepTables:
    """A step's decode rows as the kernel reads them, converted and checked once per step."""

    meta: AttentionMetadata  # every layer of a step shares this object
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    max_seq_len: int
    max_block_id: int


class CpuNativeBackend(TorchRefBackend):
    """TorchRefBackend whose decode attention runs in the native paged kernel."""

    name = "cpu"

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # its fused elementwise ops serve the model (cpu_fused.py)
        self._decode_fn = library.kvshare_paged_decode
        self._supports_shape = library.kvshare_supports_shape
        self._step: _StepTables | None = None

    def _decode(
        self,
        query: torch.Tensor,  # [B, H, D], one token per sequence
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        step = self._step_tables(meta, num_seqs)
        if not self._covers(query, k_cache, v_cache, step):
            return super()._decode(query, k_cache, v_cache, meta, scale)
        query = query.contiguous()
        out = torch.empty_like(query)
        status = self._decode_fn(
            DTYPE_CODES[query.dtype],
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            step.block_tables.data_ptr(),
            step.seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            step.block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"native paged decode failed with status {status}")
        return out

    def _step_tables(self, meta: AttentionMetadata, num_seqs: int) -> _StepTables:
        if self._step is None or self._step.meta is not meta:
            tables = meta.block_tables[:num_seqs]
            self._step = _StepTables(
                meta,
                tables.to(torch.int32).contiguous(),
                meta.seq_lens[:num_seqs].to(torch.int32).contiguous(),
                max(meta.seq_lens_host[:num_seqs], default=0),
                int(tables.max()) if tables.numel() else 0,
            )
        return self._step

    def _covers(self, query, k_cache, v_cache, step: _StepTables) -> bool:
        """Whether the kernel handles this call; it reads raw pointers, so check everything
        it assumes (anything else takes the torch path)."""
        _, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        return (
            query.dtype in DTYPE_CODES
            and query.device.type == "cpu"
            and k_cache.dtype == v_cache.dtype == query.dtype
            and k_cache.shape == v_cache.shape
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and num_heads % num_kv_heads == 0
            and bool(self._supports_shape(head_dim, num_heads // num_kv_heads))
            and step.max_seq_len <= step.block_tables.shape[1] * block_size
            and step.max_block_id < num_blocks
        )


def create_backend(build_dir: Path) -> CpuNativeBackend:
    """Build (or reuse) the kernel library under build_dir; raises NativeBuildError."""
    return CpuNativeBackend(load_library(build_dir))


@cache
def load_library(build_dir: Path) -> ctypes.CDLL:
    """The compiled kernel library, built once per (source, flags, compiler) and cached."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (install g++ or set CXX)")
    try:
        target = build_dir / f"cpu_kernels-{_build_key(compiler)}.so"
        if not target.is_file():
            _compile(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable dir, bad CXX, bad .so
        raise NativeBuildError(f"cannot build or load the kernel with {compiler!r}: {exc}") from exc
    _declare(library)
    return library


def _build_key(compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(version.encode())
    digest.update(_cpu_flags().encode())  # -march=native code is only valid on the same CPU
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent starts never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, "-shared", "-fPIC", str(SOURCE), "-o", str(built)]
        logger.info("building the native CPU attention kernel: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeBuildError(f"compiling {SOURCE.name} failed:\n{result.stderr[-2000:]}")
        built.replace(target)
    _remove_other_builds(target)


def _remove_other_builds(target: Path) -> None:
    """Drop libraries of other sources or compilers: one build per source revision would
    pile up. A process still running an old one keeps its mapping (Linux unlinks lazily)."""
    for stale in target.parent.glob("cpu_kernels-*.so"):
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
