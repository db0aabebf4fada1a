"""The native kernel paths this CPU runs, for the kernel tests' fixtures: every build level
(available_isa_levels), and on a CPU with AMX the AVX-512 levels once more with the panel kernels
on the tiles (the path of prompt tokens there, amx_panels.cpp "Panels on AMX tiles")."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from engine.runtime.cpu.capabilities import available_isa_levels, cpu_flags
from engine.runtime.cpu.native import load_library

AMX = "+amx"
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
AMX_LEVELS = ("native", "avx512")  # the builds with AVX-512, which carry the tile code


@cache
def amx_here() -> bool:
    """The CPU has AMX bf16 and Linux gives this process the tile state (what the kernel
    library asks before it takes the tiles: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA)."""
    if not cpu_flags() >= AMX_FLAGS or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None).syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0


def kernel_paths() -> list[str]:
    """Each level, then level+amx for the AVX-512 levels where AMX runs here."""
    levels = list(available_isa_levels())
    if amx_here():
        levels += [level + AMX for level in levels if level in AMX_LEVELS]
    return levels


@contextmanager
def kernel_path(build_dir: Path, path: str) -> Iterator:
    """The library of `path`'s level with the tiles on (level+amx) or off, as the path says;
    restored afterwards."""
    amx = path.endswith(AMX)
    library = load_library(build_dir, path.removesuffix(AMX))
    before = library.kvshare_panel_amx(-1)
    try:
        assert library.kvshare_panel_amx(int(amx)) == int(amx), path
        yield library
    finally:
        library.kvshare_panel_amx(before)
