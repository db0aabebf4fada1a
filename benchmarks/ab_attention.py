"""In-process A/B of the native paged attention: two or more builds, the same KV, from memory.

    python benchmarks/ab_attention.py --base DIR [--base DIR2] [--batches 1 2 4 8] \
        [--positions 540] [--rounds 31] [--isa native] [--chunks 256:0 256:256 512:0]

SmolLM2's shapes (30 layers, 9 query heads over 3 KV heads of 64, fp16 KV in 16-token blocks),
the pool on huge pages as the CPU runner allocates it (engine/runtime/cpu/allocator.py), each
sequence's blocks consecutive. Per batch size, every build runs the 30 layers' kvshare_paged_decode
(2 threads) once per round, each after a sweep of 128 MB (as in a step, where the weights have
just passed through the caches); the builds take turns within each round. Outputs are compared
first (bit for bit; a difference is printed). Prints, per build, the median over rounds and the
KV bytes read over it. Then, per --chunks ROWS:CACHED, a prefill chunk of ROWS queries after
CACHED cached tokens (each row a query at its own position, one sequence's blocks: after the
first row, its context is in cache), the 30 layers without a sweep. The builds are this tree's
engine/runtime/cpu and each DIR's (a worktree of another commit), compiled as ab_native_step.py
compiles them. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from ab_native_step import REPO, build  # noqa: E402
from kv_pages import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, run_layers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, action="append", required=True, help="another tree")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--positions", type=int, default=540, help="context of each sequence")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--isa", default="native", help="the kernels' build level")
    parser.add_argument("--chunks", nargs="*", default=[], help="prefill chunks, ROWS:CACHED")
    args = parser.parse_args(argv)

    import torch

    from engine.runtime.cpu.allocator import zeros_on_huge_pages

    trees = [REPO, *(base.resolve() for base in args.base)]
    scratch = Path(tempfile.mkdtemp())
    libraries = [build(tree, scratch / f"build{i}.so", args.isa) for i, tree in enumerate(trees)]
    blocks = -(-args.positions // BLOCK)
    pool = zeros_on_huge_pages(
        (2 * LAYERS, max(args.batches) * blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.float16
    )
    pool.normal_()
    sweep = torch.ones(32 * 1024 * 1024)

    print("| batch | build | ms (30 layers) | KV GB/s |")
    print("|---|---|---|---|")
    for batch in args.batches:
        tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks).contiguous()
        # Lengths a little apart, as a batch's sequences are.
        seq_lens = torch.tensor(
            [args.positions - 7 * i % 40 for i in range(batch)], dtype=torch.int32
        )
        query = torch.randn(batch, HEADS, HEAD_DIM)

        inputs = (pool, query, [tables] * LAYERS, seq_lens)
        times = _alternate(libraries, trees, inputs, args.rounds, f"batch {batch}", sweep)
        kv_bytes = 2 * LAYERS * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2
        for tree, seconds in zip(trees, times, strict=True):
            name = "this tree" if tree == REPO else str(tree)
            print(f"| {batch} | {name} | {1000 * seconds:.3f} | {kv_bytes / seconds / 1e9:.1f} |")

    if args.chunks:
        print("\n| chunk (rows after cached) | build | ms (30 layers) |")
        print("|---|---|---|")
    for chunk in args.chunks:
        rows, cached = (int(part) for part in chunk.split(":"))
        blocks = -(-(cached + rows) // BLOCK)
        pool = torch.randn(2 * LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.float16)
        tables = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1).contiguous()
        seq_lens = torch.arange(cached + 1, cached + rows + 1, dtype=torch.int32)
        inputs = (pool, torch.randn(rows, HEADS, HEAD_DIM), [tables] * LAYERS, seq_lens)
        times = _alternate(libraries, trees, inputs, args.rounds, f"chunk {chunk}", None)
        for tree, seconds in zip(trees, times, strict=True):
            name = "this tree" if tree == REPO else str(tree)
            print(f"| {rows} after {cached} | {name} | {1000 * seconds:.2f} |")
    return 0


def _alternate(libraries, trees, inputs, rounds: int, label: str, sweep) -> list[float]:
    """Each build's median seconds over `rounds`, the builds in turn within each round (each
    after a sweep of the caches when `sweep` is given); their outputs compared first."""
    import torch

    query = inputs[1]
    outs = [torch.empty_like(query) for _ in libraries]
    for library, out in zip(libraries, outs, strict=True):
        run_layers(library, *inputs, out)
    for tree, out in zip(trees[1:], outs[1:], strict=True):
        if not torch.equal(out, outs[0]):
            difference = (out - outs[0]).abs().max().item()
            print(f"{label}: {tree} differs from this tree by up to {difference:.3g}")
    times: list[list[float]] = [[] for _ in libraries]
    for _ in range(rounds):
        for library, out, samples in zip(libraries, outs, times, strict=True):
            if sweep is not None:
                sweep.sum()
            samples.append(run_layers(library, *inputs, out))
    return [statistics.median(samples) for samples in times]


if __name__ == "__main__":
    sys.exit(main())
