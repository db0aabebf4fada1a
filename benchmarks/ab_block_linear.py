"""In-process A/B of the block kernels per shape and row count: two builds, interleaved calls.

    python benchmarks/ab_block_linear.py --base DIR [--rows 1 3 8 64 512] [--rounds 9]
    python benchmarks/ab_block_linear.py --amx [--rows 1 8 64 512]

ab_native_step.py compares two builds of the kernels inside decode steps; prefill chunks and
single tensors need a finer look. This builds the kernel library of this tree's
engine/runtime/cpu and of DIR's (a worktree of another commit) with the product's compiler and
flags, loads SmolLM2's own tensors from the embedded GGUF (block_kernels.py's) as quantization
native holds them (panels), and calls kvshare_block_linear from one library and then the other,
round after round, on the same activations. It first checks both give the same bits at every
row count (layout, tiling and scheduling changes must), then prints each one's median time per
call and GFLOP/s, and the ratio.

With --amx the two sides are this tree's one library with its panels on AMX tiles and on the
FMAs (the paths of prompt and of generated tokens on such a CPU; amx_panels.cpp, "Panels on
AMX tiles"), switched before each call. Those sum in different orders, so each is checked
against F.linear on the dequantized weights instead (fp64, within 1e-5 of sum |x w|).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

HEAD_MAX_ROWS = 8  # the tied LM head (Q8_0) at decode row counts only


def per_call(fn, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sides = parser.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", type=Path, help="the other tree (a worktree)")
    sides.add_argument("--amx", action="store_true", help="this tree's AMX tiles against its FMAs")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="native", help="the kernels' build level")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from ab_native_step import build
    from block_kernels import HEAD, smollm2_block_weights

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import BlockLinear, to_panels

    torch.set_num_threads(args.threads)
    weights = smollm2_block_weights(EngineConfig())
    with tempfile.TemporaryDirectory() as scratch:
        this = build(REPO, Path(scratch) / "this.so", args.isa)
        if args.amx:
            if not this.kvshare_panel_amx(1):
                print("no AMX here (the CPU lacks amx_bf16, or Linux refused the tile state)")
                return 1
            # side -> (library, its AMX switch before each call)
            sides = {"AMX": (this, 1), "FMA": (this, 0)}
        else:
            sides = {"this tree": (this, None), "base": (build(args.base.resolve(),
                     Path(scratch) / "base.so", args.isa), None)}  # fmt: skip
        first, second = sides
        print(f"threads {args.threads}, build level {args.isa}, {args.rounds} interleaved rounds")
        print(f"| tensor | rows | {first} us (GFLOP/s) | {second} us (GFLOP/s) "
              f"| {second} / {first} |\n|---|---|---|---|---|")  # fmt: skip
        for name, stored in weights.items():
            weight = to_panels(stored)
            reference = stored.dequantize().double() if args.amx else None
            calls = {}
            for key, (library, amx) in sides.items():
                module = BlockLinear(weight, None, library)

                def call(x, module=module, library=library, amx=amx):
                    if amx is not None:
                        library.kvshare_panel_amx(amx)
                    return module(x)

                calls[key] = call
            for rows in args.rows:
                if name == HEAD and rows > HEAD_MAX_ROWS:
                    continue
                seed = torch.Generator().manual_seed(0)
                x = torch.randn(rows, weight.in_features, generator=seed)
                with torch.inference_mode():
                    outs = {key: call(x) for key, call in calls.items()}
                    if reference is None:
                        if not torch.equal(outs[first], outs[second]):
                            raise SystemExit(f"the two builds differ on {name} at {rows} rows")
                    else:
                        expected = F.linear(x.double(), reference)
                        bound = F.linear(x.double().abs(), reference.abs()) * 1e-5 + 1e-12
                        for key, out in outs.items():
                            if not ((out.double() - expected).abs() <= bound).all():
                                raise SystemExit(f"{key} is off F.linear on {name}, {rows} rows")
                    reps = 20 if name == HEAD else max(1, 2000 // rows)
                    times = {key: [] for key in calls}
                    for _ in range(args.rounds):
                        for key, call in calls.items():
                            times[key].append(per_call(lambda c=call, x=x: c(x), reps))
                flops = 2 * rows * weight.in_features * weight.out_features
                a, b = (statistics.median(times[key]) for key in (first, second))
                print(
                    f"| {name} | {rows} | {1e6 * a:.1f} ({flops / a / 1e9:.0f}) "
                    f"| {1e6 * b:.1f} ({flops / b / 1e9:.0f}) | {b / a:.2f}x |",
                    flush=True,
                )
        if args.amx:
            this.kvshare_panel_amx(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
