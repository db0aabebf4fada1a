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


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("num_bytes", [1, 3 * 1024 * 1024 + 5, 40 * 1024 * 1024])
def test_zeros_on_huge_pages_are_zeros_on_a_2mib_boundary(num_bytes: int) -> None:
    import torch

    from engine.runtime.cpu.allocator import HUGE_PAGE_BYTES, zeros_on_huge_pages

    slab = zeros_on_huge_pages((num_bytes,), torch.uint8)
    assert slab.dtype == torch.uint8 and slab.shape == (num_bytes,) and slab.is_contiguous()
    assert slab.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not slab.any()


def test_the_kv_slab_is_offered_as_huge_pages() -> None:
    """Where the kernel takes advice (THP "madvise" or "always"), the slab's mapping is
    eligible for transparent huge pages; whether it gets them depends on free memory."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not setting.exists():
        pytest.skip("no transparent huge pages here")
    if "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    import torch

    from engine.runtime.cpu.allocator import zeros_on_huge_pages

    slab = zeros_on_huge_pages((40 * 1024 * 1024,), torch.uint8)
    mapping = _mapping_of(slab.data_ptr())
    if "THPeligible" not in mapping:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert mapping["THPeligible"] == "1"
