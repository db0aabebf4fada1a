"""The allocator settings a CPU runner applies to its process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter (no torch, nothing freed yet, so glibc's adaptive mmap threshold
# is still at its 128 KiB start): how many bytes does a 24 MiB malloc add to mmapped chunks?
_PROBE = """
import ctypes, sys
from engine.runtime.cpu import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print("skip"); sys.exit()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    assert allocator.keep_temporaries_on_heap()
    assert allocator.keep_temporaries_on_heap()  # idempotent
before = libc.mallinfo2().hblkhd
block = libc.malloc(24 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def mapped_bytes_of_a_24mib_block(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    if result.stdout.strip() == "skip":
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_temporaries_stay_on_the_heap() -> None:
    assert mapped_bytes_of_a_24mib_block("default") >= 24 << 20  # glibc's own choice: mmap
    assert mapped_bytes_of_a_24mib_block("tuned") == 0  # tuned: served from the heap
