"""benchmarks/ab.py's linear subcommands: block-linear (the block kernels against another
tree's, or AMX tiles against FMAs) and prefill-gemm (the prefill GEMM, the FMA path and
dequantize + F.linear against the machine's FMA peak)."""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks.ab_harness import (
    REPO,
    build,
    build_each,
    check_same_bits,
    interleave,
    medians,
    per_call,
    print_header,
    print_row,
    seconds_of,
)

HEAD_MAX_ROWS = 8  # block-linear: the tied LM head (Q8_0) at decode row counts only
# SmolLM2-135M's projections of layer 0, fused as the loader fuses them (cpu/gguf_blocks.py)
SMOLLM2_PROJECTIONS = {
    "qkv": "model.layers.0.self_attn.qkv_proj",
    "o": "model.layers.0.self_attn.o_proj",
    "gate_up": "model.layers.0.mlp.gate_up_proj",
    "down": "model.layers.0.mlp.down_proj",
}


def block_linear(args: argparse.Namespace) -> int:
    """The block kernels per shape and row count: two builds, interleaved calls.

    native-step compares two builds inside decode steps; prefill chunks and single tensors need a
    finer look. This loads SmolLM2's own tensors from the embedded GGUF (block_kernels.py's) as
    quantization native holds them (panels) and calls kvshare_block_linear from this tree's library
    and then DIR's, round after round, on the same activations. It first checks both give the same
    bits at every row count (layout, tiling and scheduling changes must), then prints each one's
    median time per call and GFLOP/s, and the ratio.

    With --amx the two sides are this tree's one library with its panels on AMX tiles and on the
    FMAs (the paths of prompt and of generated tokens on such a CPU; amx_panels.cpp), switched
    before each call. Those sum in different orders, so each is checked against F.linear on the
    dequantized weights instead (fp64, within 1e-5 of sum |x w|)."""
    import torch
    from block_kernels import HEAD, smollm2_block_weights

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import to_panels

    torch.set_num_threads(args.threads)
    weights = smollm2_block_weights(EngineConfig())
    entry_points = ("kvshare_block_linear_rows", *(("kvshare_panel_amx",) if args.amx else ()))
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": REPO} if args.amx else {"this tree": REPO, "base": args.base}
        libraries = build_each(trees, Path(scratch), args.isa, entry_points)
        this = libraries["this tree"]
        if args.amx:
            if not this.kvshare_panel_amx(1):
                print("no AMX here (the CPU lacks amx_bf16, or Linux refused the tile state)")
                return 1
            sides = {"AMX": (this, 1), "FMA": (this, 0)}  # side -> (library, its AMX switch)
        else:
            sides = {name: (library, None) for name, library in libraries.items()}
        first, second = sides
        print(f"threads {args.threads}, build level {args.isa}, {args.rounds} interleaved rounds")
        print_header("tensor", "rows", f"{first} us (GFLOP/s)", f"{second} us (GFLOP/s)",
                     f"{second} / {first}")  # fmt: skip
        for name, stored in weights.items():
            rows = [r for r in args.rows if name != HEAD or r <= HEAD_MAX_ROWS]
            _block_linear_rows(args, name == HEAD, name, stored, to_panels(stored), sides, rows)
        if args.amx:
            this.kvshare_panel_amx(0)
    return 0


def _block_linear_rows(args, is_head: bool, name: str, stored, weight, sides, row_counts) -> None:
    """One tensor's table rows: per row count, the sides checked, then timed in turns."""
    import torch
    import torch.nn.functional as F

    from engine.runtime.cpu.block_linear import BlockLinear

    reference = stored.dequantize().double() if args.amx else None
    calls = {}
    for key, (library, amx) in sides.items():
        module = BlockLinear(weight, None, library)

        def call(x, module=module, library=library, amx=amx):
            if amx is not None:
                library.kvshare_panel_amx(amx)
            return module(x)

        calls[key] = call
    for rows in row_counts:
        x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            outs = {key: call(x) for key, call in calls.items()}
            if reference is None:
                check_same_bits(outs, f"{name} at {rows} rows")
            else:
                expected = F.linear(x.double(), reference)
                bound = F.linear(x.double().abs(), reference.abs()) * 1e-5 + 1e-12
                for key, out in outs.items():
                    if not ((out.double() - expected).abs() <= bound).all():
                        raise SystemExit(f"{key} is off F.linear on {name}, {rows} rows")
            reps = 20 if is_head else max(1, 2000 // rows)
            variants = {key: partial(per_call, partial(c, x), reps) for key, c in calls.items()}
            a, b = medians(interleave(variants, args.rounds)).values()
        flops = 2 * rows * weight.in_features * weight.out_features
        print_row(name, rows, f"{1e6 * a:.1f} ({flops / a / 1e9:.0f})",
                  f"{1e6 * b:.1f} ({flops / b / 1e9:.0f})", f"{b / a:.2f}x")  # fmt: skip


# The machine's FMA peak: 12 independent chains of FMAs on the level's widest registers (more
# chains than the FMA latency needs), each thread its own; returns the FLOPs it did.
FMA_PEAK_SOURCE = r"""
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#elif defined(__AVX2__)
typedef float vec __attribute__((vector_size(32)));
#else
typedef float vec __attribute__((vector_size(16)));
#endif
volatile float kept;  // the sums, so that the loop is not optimized away
extern "C" double fma_peak_loop(long iterations, int threads);
double fma_peak_loop(long iterations, int threads) {
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    vec acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = vec{} + float(i);
    const vec m = vec{} + 0.999999f, c = vec{} + 1e-7f;
    for (long it = 0; it < iterations; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = acc[i] * m + c;
    for (int i = 0; i < 12; ++i) total += acc[i][0];
  }
  kept = total;
  return 2.0 * sizeof(vec) / sizeof(float) * 12 * iterations * threads;
}
"""
PEAK_ITERATIONS = 200_000  # ~1 ms a thread at 3.5 GHz


def prefill_gemm(args: argparse.Namespace) -> int:
    """The prefill GEMM against the block kernels' FMA path and torch, per SmolLM2 projection.

    SmolLM2-135M's four projections of layer 0 from the embedded GGUF (Q4_1, in panels as
    quantization native holds them: qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down
    1536 -> 576), a prompt chunk of --rows rows, this tree's library: kvshare_prefill_gemm (what a
    prompt row takes without AMX tiles), kvshare_block_linear on the FMAs (the path the prompt
    rows took before), the blocks dequantized at each call then F.linear (torch's fp32 GEMM), and
    F.linear on resident fp32 weights, in turns each round with a register-only FMA loop (the
    machine's FMA peak, built for the same level). Each path is first checked against F.linear on
    the dequantized weights (fp64, within 1e-5 of sum |x w|). Prints each path's median GFLOP/s
    and its fraction of the peak's median."""
    import torch
    import torch.nn.functional as F
    from block_kernels import dequantizing_candidate

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import to_panels
    from engine.runtime.cpu.gguf_blocks import read_blocks
    from engine.runtime.loader import resolve_model_source

    torch.set_num_threads(args.threads)
    blocks, _ = read_blocks(resolve_model_source(EngineConfig()).gguf_path, 9, 3)
    with tempfile.TemporaryDirectory() as scratch:
        library = build(REPO, Path(scratch) / "kernels.so", args.isa, ("kvshare_prefill_gemm",))
        peak = _fma_peak_library(Path(scratch), args.isa)
        library.kvshare_panel_amx(0)
        print(f"threads {args.threads}, build level {args.isa}, {args.rows} rows, "
              f"{args.rounds} interleaved rounds")  # fmt: skip
        print_header("projection", "path", "ms", "GFLOP/s", "of FMA peak")
        for name, module in SMOLLM2_PROJECTIONS.items():
            weight = to_panels(blocks[module])
            x = torch.randn(
                args.rows, weight.in_features, generator=torch.Generator().manual_seed(0)
            )
            paths = _prefill_paths(library, weight, x, dequantizing_candidate(weight, library))
            dense = blocks[module].dequantize()
            paths["F.linear, fp32 weights"] = lambda x=x, dense=dense: F.linear(x, dense)
            _check_prefill_paths(paths, x, dense.double(), name)
            paths["FMA peak"] = lambda: peak.fma_peak_loop(PEAK_ITERATIONS, args.threads)
            with torch.inference_mode():
                times = medians(interleave({k: partial(seconds_of, f) for k, f in paths.items()},
                                           args.rounds))  # fmt: skip
            peak_flops = (
                peak.fma_peak_loop(1, args.threads) * PEAK_ITERATIONS / times.pop("FMA peak")
            )
            flops = 2 * args.rows * weight.in_features * weight.out_features
            for path, seconds in times.items():
                print_row(name, path, f"{1e3 * seconds:.3f}", f"{flops / seconds / 1e9:.1f}",
                          f"{flops / seconds / peak_flops:.0%}")  # fmt: skip
            print_row(name, "FMA peak", "", f"{peak_flops / 1e9:.1f}", "100%")
    return 0


def _prefill_paths(library, weight, x, dequantizing) -> dict[str, Callable[[], object]]:
    """The kernels' paths and the dequantizing one, each a call on x into its own output."""
    import torch

    def kernel(entry, *tail):
        out = torch.empty(x.shape[0], weight.out_features)
        head = (weight.code, x.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0])
        size = (weight.in_features, weight.out_features, torch.get_num_threads())

        def call() -> torch.Tensor:
            if entry(*head, *size, *tail) != 0:
                raise SystemExit(f"{entry.__name__} failed")
            return out

        return call

    return {
        "prefill GEMM": kernel(library.kvshare_prefill_gemm),
        "FMA block path": kernel(library.kvshare_block_linear_rows, None),
        "dequantize + F.linear": lambda: dequantizing(x),
    }


def _check_prefill_paths(paths: dict, x, dense, name: str) -> None:
    import torch.nn.functional as F

    expected = F.linear(x.double(), dense)
    bound = F.linear(x.double().abs(), dense.abs()) * 1e-5 + 1e-12
    for path, call in paths.items():
        if not ((call().double() - expected).abs() <= bound).all():
            raise SystemExit(f"{path} is off F.linear on {name}")


def _fma_peak_library(scratch: Path, isa: str) -> ctypes.CDLL:
    """FMA_PEAK_SOURCE built with the kernels' flags for `isa`."""
    import subprocess

    from engine.runtime.cpu import native

    source, target = scratch / "fma_peak.cpp", scratch / "fma_peak.so"
    source.write_text(FMA_PEAK_SOURCE)
    flags = [*native.compile_flags(isa), "-fPIC", "-shared"]
    subprocess.run([native._find_compiler(), *flags, str(source), "-o", str(target)], check=True)
    library = ctypes.CDLL(str(target))
    library.fma_peak_loop.restype = ctypes.c_double
    library.fma_peak_loop.argtypes = [ctypes.c_long, ctypes.c_int]
    return library


# --- the command line ---------------------------------------------------------------------------
