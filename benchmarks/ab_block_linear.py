"""In-process A/B of the block kernels per shape and row count: two builds, interleaved calls.

    python benchmarks/ab_block_linear.py --base DIR [--rows 1 3 8 64 512] [--rounds 9]

ab_native_step.py compares two builds of the kernels inside decode steps; prefill chunks and
single tensors need a finer look. This builds the kernel library of this tree's
engine/runtime/cpu and of DIR's (a worktree of another commit) with the product's compiler and
flags, loads SmolLM2's own tensors from the embedded GGUF (block_kernels.py's) as quantization
native holds them (panels), and calls kvshare_block_linear from one library and then the other,
round after round, on the same activations. It first checks both give the same bits at every
row count (layout, tiling and scheduling changes must), then prints each one's median time per
call and GFLOP/s, and the ratio.
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
    parser.add_argument("--base", type=Path, required=True, help="the other tree (a worktree)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="native", help="the kernels' build level")
    args = parser.parse_args(argv)

    import torch
    from ab_native_step import build
    from block_kernels import HEAD, smollm2_block_weights

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import BlockLinear, to_panels

    torch.set_num_threads(args.threads)
    weights = smollm2_block_weights(EngineConfig())
    print(f"threads {args.threads}, build level {args.isa}, {args.rounds} interleaved rounds")
    print("| tensor | rows | this tree us (GFLOP/s) | base us (GFLOP/s) | base / this |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        libraries = {
            "this": build(REPO, Path(scratch) / "this.so", args.isa),
            "base": build(args.base.resolve(), Path(scratch) / "base.so", args.isa),
        }
        for name, stored in weights.items():
            weight = to_panels(stored)
            modules = {key: BlockLinear(weight, None, lib) for key, lib in libraries.items()}
            for rows in args.rows:
                if name == HEAD and rows > HEAD_MAX_ROWS:
                    continue
                seed = torch.Generator().manual_seed(0)
                x = torch.randn(rows, weight.in_features, generator=seed)
                with torch.inference_mode():
                    if not torch.equal(modules["this"](x), modules["base"](x)):
                        raise SystemExit(f"the two builds differ on {name} at {rows} rows")
                    reps = 20 if name == HEAD else max(1, 2000 // rows)
                    times = {key: [] for key in modules}
                    for _ in range(args.rounds):
                        for key, module in modules.items():
                            times[key].append(per_call(lambda m=module, x=x: m(x), reps))
                flops = 2 * rows * weight.in_features * weight.out_features
                this, base = (statistics.median(times[key]) for key in ("this", "base"))
                print(
                    f"| {name} | {rows} | {1e6 * this:.1f} ({flops / this / 1e9:.0f}) "
                    f"| {1e6 * base:.1f} ({flops / base / 1e9:.0f}) | {base / this:.2f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
