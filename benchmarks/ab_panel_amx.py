"""In-process A/B of the panel kernels on AMX tiles against the FMA path, per tensor and row count.

    python benchmarks/ab_panel_amx.py [--rows 1 8 64 512] [--rounds 9]

Where the CPU has AMX bf16 (and the OS lets the process use it), quantization native multiplies
its panels on the tiles at every row count (block_kernels.cpp, "Panels on AMX tiles"). This loads
SmolLM2's own tensors from the embedded GGUF as quantization native holds them (panels), builds
the product's kernel library, and calls kvshare_block_linear with the tiles on, then off (the FMA
path), round after round on the same activations. The two paths sum in different orders, so
each is first checked against F.linear on the dequantized weights (fp64, within 1e-5 of
sum |x w|); then it prints each one's median time per call, GFLOP/s and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="native", help="the kernels' build level")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from ab_block_linear import HEAD_MAX_ROWS, per_call
    from ab_native_step import build
    from block_kernels import HEAD, smollm2_block_weights

    from engine.core.config import EngineConfig
    from engine.runtime.cpu.block_linear import BlockLinear, to_panels

    torch.set_num_threads(args.threads)
    weights = smollm2_block_weights(EngineConfig())
    with tempfile.TemporaryDirectory() as scratch:
        library = build(REPO, Path(scratch) / "this.so", args.isa)
        if not library.kvshare_panel_amx(1):
            print("no AMX here (the CPU lacks amx_bf16, or the OS refused the tile state)")
            return 1
        print(f"threads {args.threads}, build level {args.isa}, {args.rounds} interleaved rounds")
        print("| tensor | rows | AMX us (GFLOP/s) | FMA us (GFLOP/s) | FMA / AMX |")
        print("|---|---|---|---|---|")
        for name, stored in weights.items():
            weight = to_panels(stored)
            module = BlockLinear(weight, None, library)
            reference = stored.dequantize().double()
            for rows in args.rows:
                if name == HEAD and rows > HEAD_MAX_ROWS:
                    continue
                seed = torch.Generator().manual_seed(0)
                x = torch.randn(rows, weight.in_features, generator=seed)
                expected = F.linear(x.double(), reference)
                bound = F.linear(x.double().abs(), reference.abs()) * 1e-5 + 1e-12
                reps = 20 if name == HEAD else max(1, 2000 // rows)
                times = {"amx": [], "fma": []}
                with torch.inference_mode():
                    for path in times:
                        library.kvshare_panel_amx(int(path == "amx"))
                        if not ((module(x).double() - expected).abs() <= bound).all():
                            raise SystemExit(f"{path} is off the reference on {name}, {rows} rows")
                    for _ in range(args.rounds):
                        for path in times:
                            library.kvshare_panel_amx(int(path == "amx"))
                            times[path].append(per_call(lambda x=x, m=module: m(x), reps))
                library.kvshare_panel_amx(1)
                flops = 2 * rows * weight.in_features * weight.out_features
                amx, fma = (statistics.median(times[path]) for path in ("amx", "fma"))
                print(
                    f"| {name} | {rows} | {1e6 * amx:.1f} ({flops / amx / 1e9:.0f}) "
                    f"| {1e6 * fma:.1f} ({flops / fma / 1e9:.0f}) | {fma / amx:.2f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
