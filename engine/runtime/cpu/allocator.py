"""Process settings that make torch on the CPU fast; applied once when a CPU runner starts.

glibc serves every allocation above its mmap threshold (128 KiB at start, adapted upwards
only after a free) with a fresh mmap, and returns it with munmap on free. A forward pass
allocates and frees activations of megabytes per op, so every op would start by faulting
in and zeroing fresh pages: measured on SmolLM2 (bf16, 2048-token prefill chunks) an RMSNorm
took 4.6 ms with the defaults and 0.5 ms with the heap kept. Raising the mmap threshold to
its maximum (32 MiB on 64-bit glibc; larger temporaries are still mapped per use) and the trim
threshold above it keeps freed activations in the heap for reuse. The runner applies it after
loading the weights, so they keep their own mappings and freeing them leaves no heap holes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and glibc's largest accepted mmap threshold on 64-bit.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 512 * 1024 * 1024

_applied = False

_MADV_HUGEPAGE = 14  # Linux madvise advice (asm-generic/mman-common.h)
HUGE_PAGE_BYTES = 2 * 1024 * 1024


def _libc_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's `name` with its signature set, or None where there is none (not Linux,
    or a C library without it: musl has no mallopt or malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name
        )
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def keep_temporaries_on_heap() -> bool:
    """Tune glibc malloc as above; False (and nothing changed) off glibc. Idempotent."""
    global _applied
    if _applied:
        return True
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused the allocator settings; CPU steps may be slower")
    _applied = ok
    return ok


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's malloc_trim): after
    quantization drops the fp32 weights, the process's resident size shows the blocks alone."""
    gc.collect()
    malloc_trim = _libc_function("malloc_trim", [ctypes.c_size_t])
    if malloc_trim is not None:
        malloc_trim(0)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor starting on a 2 MiB boundary, its whole 2 MiB pages offered
    to the kernel as transparent huge pages (madvise MADV_HUGEPAGE) before the first touch.
    For the KV pool: a decode row reads its blocks wherever the pool placed them, and once the
    prefix cache has churned they lie scattered over the gigabyte, so with 4 KiB pages nearly
    every block is a TLB miss. Best effort: where the kernel declines (THP "never", not Linux)
    the pages stay small and nothing else changes."""
    num_bytes = math.prod(shape) * dtype.itemsize
    buffer = torch.empty(num_bytes + HUGE_PAGE_BYTES, dtype=torch.uint8)  # not touched yet
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
    slab = buffer[offset : offset + num_bytes]
    whole = num_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    madvise = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    if whole and madvise is not None and madvise(slab.data_ptr(), whole, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) declined: errno %d", ctypes.get_errno())
    return slab.zero_().view(dtype).view(shape)
