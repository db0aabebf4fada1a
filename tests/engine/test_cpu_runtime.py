"""The allocator settings a CPU runner applies to its process."""

from __future__ import annotations

import ctypes
import sys

import pytest

from engine import cpu_runtime


class MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2 (every field a size_t)
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_temporaries_stay_on_the_heap() -> None:
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    assert cpu_runtime.keep_temporaries_on_heap()
    assert cpu_runtime.keep_temporaries_on_heap()  # idempotent
    # A 16 MiB block (far above glibc's default 128 KiB mmap threshold) now comes from the
    # heap, not from a fresh mmap: the bytes held in mmapped chunks do not grow.
    mapped_before = libc.mallinfo2().hblkhd
    block = libc.malloc(16 << 20)
    mapped_during = libc.mallinfo2().hblkhd
    libc.free(block)
    assert mapped_during == mapped_before
