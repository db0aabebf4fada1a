"""What this CPU can run, probed once: the one answer kvshare's CPU code paths ask.

Four answers differ between the x86-64 CPUs kvshare runs on:

- bf16_linear: whether oneDNN can pack and run bfloat16 linears. It needs AVX-512 (BW, VL,
  DQ) or AVX-NE-CONVERT; on an AVX2-only CPU mkldnn._reorder_linear_weight refuses bf16, so
  there bf16 models keep plain nn.Linear (engine/runtime/cpu/linear.py, can_pack).
- isa: the best vector level the native kernels (engine/runtime/cpu/*.cpp, built by
  engine/runtime/cpu/native.py) can target here, from the /proc/cpuinfo flags: "avx512"
  (x86-64-v4: avx512f, bw, vl, dq, cd), "avx2" (x86-64-v3: avx2, fma, bmi1/2, f16c, movbe,
  lzcnt), "baseline" (x86-64-v2: sse4_2, popcnt, ...), or "native" off x86-64 or without those
  flags, where only the compiler's own -march=native is offered.
- amx: whether quantization native's panel kernels multiply a request's prompt tokens on AMX
  tiles (amx_tile and amx_bf16 in the flags, Intel Xeons from Sapphire Rapids on); the tokens it
  generates stay on the FMAs (engine/runtime/step_inputs.py, tile_rows: prefill about 2x
  faster on the tiles, a lone decode row 1.7x slower). The kernel library also asks Linux for
  the tile state and keeps the FMA path where it is refused (amx_panels.cpp).
- prompt_rows: whether the runner marks a request's prompt tokens (tile_rows) so that the block
  kernels run them on their prompt path: the AMX tiles where amx says so, else the prefill GEMM
  (prefill_gemm.cpp: each weight expanded to fp32 once per chunk, then plain FMAs). Off where a
  switch below keeps prompt tokens on the FMAs: on a CPU with the tiles the kernels would take
  them for a marked row, so KVSHARE_CPU_AMX=0 turns marking off there.

Four environment variables choose another path than the default one, to run (or test) it on a CPU
that has the better one, or to step around a fast path that misbehaves:

- KVSHARE_CPU_ISA=avx512|avx2|baseline builds the native kernels for that level
  (-march=x86-64-v4, -v3 or -v2: the portable builds a runtime image ships prebuilt) instead
  of -march=native. A level above this CPU's is ignored with a warning: its code would stop on
  an illegal instruction.
- KVSHARE_CPU_BF16_LINEAR=0 never packs bfloat16 linears; they run on F.linear.
- KVSHARE_CPU_AMX=0 keeps every row of the panel kernels on the FMAs (see amx).
- KVSHARE_CPU_PREFILL_GEMM=0 keeps prompt tokens off the prefill GEMM, on the FMAs, where the
  CPU has no AMX tiles (see prompt_rows).

All are read when cpu_capabilities() first runs (it is cached; tests clear the cache).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "KVSHARE_CPU_ISA"
BF16_LINEAR_ENV = "KVSHARE_CPU_BF16_LINEAR"
AMX_ENV = "KVSHARE_CPU_AMX"
PREFILL_GEMM_ENV = "KVSHARE_CPU_PREFILL_GEMM"
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
_OFF = ("0", "false", "no", "off")

# x86-64 vector levels, best first, with the /proc/cpuinfo flags each needs: all of what
# -march=x86-64-v4 / -v3 / -v2 let the compiler use (the portable builds already use BMI2's
# shifts), so a VM that hides one of them gets a lower level, never an illegal instruction.
# "abm" is how Linux names LZCNT. Each level also needs those of the levels below it.
_V2 = frozenset({"sse4_2", "popcnt", "ssse3", "sse4_1", "cx16", "lahf_lm"})
_V3 = _V2 | {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_ISA_FLAGS = (("avx512", _V4), ("avx2", _V3), ("baseline", _V2))
_ISA_ORDER = tuple(level for level, _ in _ISA_FLAGS)
FORCED_LEVELS = ("avx512", "avx2", "baseline")  # the portable kernel builds, best first


@dataclass(frozen=True)
class CpuCapabilities:
    """What the CPU code paths may use in this process.

    isa: "avx512" | "avx2" | "baseline" | "native" (the detected level, or a forced lower one).
    bf16_linear: oneDNN packs and runs bf16 linears (False when forced off).
    kernel_isa: the level the native kernels are built for: "native", or the forced level.
    amx: the panel kernels run prompt tokens on AMX tiles (a CPU that has them, unless
    KVSHARE_CPU_AMX=0 or a forced level below avx512: only the AVX-512 builds carry them).
    prompt_rows: the runner marks prompt tokens for the kernels' prompt path (the tiles where
    amx, else the prefill GEMM), unless KVSHARE_CPU_AMX=0 on a CPU with the tiles or
    KVSHARE_CPU_PREFILL_GEMM=0 on one without.
    """

    isa: str
    bf16_linear: bool
    kernel_isa: str = "native"
    amx: bool = False
    prompt_rows: bool = True

    def kernel_levels(self) -> tuple[str, ...]:
        """Every kernel build level whose code runs here: kernel_isa first, then each lower
        forced level (on an AVX-512 CPU: native, avx512, avx2, baseline)."""
        lower = self.levels_run(FORCED_LEVELS)
        return (self.kernel_isa, *(level for level in lower if level != self.kernel_isa))

    def levels_run(self, levels: tuple[str, ...]) -> tuple[str, ...]:
        """Those of `levels` (names of x86-64 levels) whose code runs here, in their order."""
        return tuple(level for level in levels if _runs_on(level, self.isa))


@cache
def cpu_capabilities() -> CpuCapabilities:
    """This process's answer: probe() of its environment and CPU, computed once."""
    capabilities = probe()
    logger.info("CPU capabilities: %s", capabilities)
    return capabilities


def levels_run_here(levels: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `levels` (names of x86-64 levels) whose code this CPU executes, in their order."""
    return cpu_capabilities().levels_run(levels)


def available_isa_levels() -> tuple[str, ...]:
    """The native kernel build levels this CPU executes (see CpuCapabilities.kernel_levels)."""
    return cpu_capabilities().kernel_levels()


def probe(
    environ: Mapping[str, str] | None = None,
    flags: frozenset[str] | None = None,
    bf16_supported: bool | None = None,
) -> CpuCapabilities:
    """The capabilities for these inputs; each left None is read from this process (os.environ,
    /proc/cpuinfo, oneDNN), so a test can ask what another CPU would get."""
    environ = os.environ if environ is None else environ
    flags = cpu_flags() if flags is None else flags
    detected = _detect_isa(flags)
    forced = _forced_isa(environ.get(ISA_ENV, ""), detected)
    bf16 = _onednn_bf16_supported() if bf16_supported is None else bf16_supported
    bf16_off = environ.get(BF16_LINEAR_ENV, "").strip().lower() in _OFF
    amx_off = environ.get(AMX_ENV, "").strip().lower() in _OFF
    gemm_off = environ.get(PREFILL_GEMM_ENV, "").strip().lower() in _OFF
    isa = forced or detected
    tiles = flags >= _AMX_FLAGS and isa == "avx512"  # the tile code's builds
    return CpuCapabilities(
        isa=isa,
        bf16_linear=bf16 and not bf16_off,
        kernel_isa=forced or "native",
        amx=tiles and not amx_off,
        prompt_rows=not amx_off if tiles else not gemm_off,
    )


@cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor; empty off Linux x86 (ARM says Features)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _detect_isa(flags: frozenset[str]) -> str:
    return next((level for level, needed in _ISA_FLAGS if needed <= flags), "native")


def _runs_on(level: str, isa: str) -> bool:
    """Whether code built for `level` runs on a CPU whose best level is `isa`."""
    return isa in _ISA_ORDER and _ISA_ORDER.index(level) >= _ISA_ORDER.index(isa)


def _forced_isa(value: str, detected: str) -> str | None:
    value = value.strip().lower()
    if value in ("", "native"):
        return None
    if value not in FORCED_LEVELS:
        logger.warning("ignoring %s=%s: expected native, avx512, avx2 or baseline", ISA_ENV, value)
        return None
    if not _runs_on(value, detected):
        logger.warning("ignoring %s=%s: this CPU's best level is %s", ISA_ENV, value, detected)
        return None
    return value


def _onednn_bf16_supported() -> bool:
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
