r"""In-process A/B benchmarks: two or more variants of the kernels or the engine, timed in turns.

    python benchmarks/ab.py attention --base DIR [--base DIR2] [--batches 1 2 4 8] \
        [--positions 540] [--rounds 31] [--isa native] [--chunks 256:0 256:256 512:0]
    python benchmarks/ab.py block-linear (--base DIR | --amx) [--rows 1 3 8 64 512] \
        [--rounds 9] [--threads 2] [--isa native]
    python benchmarks/ab.py native-step --base DIR [--batches 1 8] [--steps 600] \
        [--prompt-tokens 240] [--different-bits] [--isa native]
    python benchmarks/ab.py greedy-head [--batches 8 4 1] [--steps 300] [--prompt-tokens 300]
    python benchmarks/ab.py prefill-gemm [--rows 256] [--rounds 15] [--threads 2] [--isa native]

On a shared host two runs of the same code differ by more than most kernel changes do. Here the
variants take turns within each round (a round: one call or one decode step of each), so they
see the same host at the same moment; each reports its median over the rounds. Their outputs
are compared bit for bit before any timing. DIR is another tree (a worktree, or `git archive` of
another commit): the library of its own engine/runtime/cpu/*.cpp, built with this tree's
compiler and flags (engine/runtime/cpu/native.py). `ab.py SUBCOMMAND --help` says what each
times. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from benchmarks.ab_linears import block_linear, prefill_gemm  # noqa: E402
from benchmarks.ab_steps import attention, greedy_head, native_step  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=run.__doc__.split("\n")[0],
            description=inspect.cleandoc(run.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=run)
        return sub

    isa = {"default": "native", "help": "the kernels' build level"}
    sub = command("attention", attention)
    sub.add_argument("--base", type=Path, action="append", required=True, help="another tree")
    sub.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    sub.add_argument("--positions", type=int, default=540, help="context of each sequence")
    sub.add_argument("--rounds", type=int, default=31)
    sub.add_argument("--isa", **isa)
    sub.add_argument("--chunks", nargs="*", default=[], help="prefill chunks, ROWS:CACHED")

    sub = command("block-linear", block_linear)
    sides = sub.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", type=Path, help="the other tree")
    sides.add_argument("--amx", action="store_true", help="this tree's AMX tiles against its FMAs")
    sub.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 64, 512])
    sub.add_argument("--rounds", type=int, default=9)
    sub.add_argument("--threads", type=int, default=2)
    sub.add_argument("--isa", **isa)

    sub = command("native-step", native_step)
    sub.add_argument("--base", type=Path, required=True, help="the other tree")
    sub.add_argument("--batches", type=int, nargs="+", default=[1])
    sub.add_argument("--steps", type=int, default=600, help="decode steps per batch size")
    sub.add_argument("--isa", **isa)
    sub.add_argument("--prompt-tokens", type=int, default=240, help="each prompt's length")
    sub.add_argument("--model", default=None, help="as kvshare serve --model (default SmolLM2)")
    sub.add_argument(
        "--different-bits",
        action="store_true",
        help="time builds whose outputs differ (a changed summation order): print the difference",
    )

    sub = command("greedy-head", greedy_head)
    sub.add_argument("--batches", type=int, nargs="+", default=[8, 4, 1])
    sub.add_argument("--steps", type=int, default=300, help="decode steps per batch size")
    sub.add_argument("--prompt-tokens", type=int, default=300)

    sub = command("prefill-gemm", prefill_gemm)
    sub.add_argument("--rows", type=int, default=256, help="the prompt chunk's rows")
    sub.add_argument("--rounds", type=int, default=15)
    sub.add_argument("--threads", type=int, default=2)
    sub.add_argument("--isa", **isa)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
