"""The step profile and the serving benchmark on two source trees, in interleaved rounds: a
change that should not move speed (a restructure) shown within noise, side by side in one run.

    git worktree add /tmp/before <rev>   # or: git archive <rev> | tar -x -C /tmp/before
    .venv/bin/python benchmarks/two_trees.py --before /tmp/before --rounds 3

Each round runs both trees, in alternating order: the step profile (each tree's own
benchmarks/profile_step.py, the engine offline) and a `kvshare serve` of each tree
(config/cpu.yaml) under this tree's serving client (benchmarks/serving.py). Both trees run
with this checkout's virtual environment. Prints the medians per tree and the after / before
ratio of each figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.servers import free_port, start_server, stop_server  # noqa: E402


def profile(tree: Path, profile_args: list[str], out: Path) -> dict[str, float]:
    """The step profile of `tree` by its own benchmarks/profile_step.py (a tree's modules can
    differ from this one's): each row's median step in ms, by the row's name."""
    command = [sys.executable, "benchmarks/profile_step.py", "--out", str(out), *profile_args]
    subprocess.run(command, cwd=tree, check=True, capture_output=True)
    return {row["name"] + " ms": row["step_ms"] for row in json.loads(out.read_text())["rows"]}


def serve(tree: Path, client_args: list[str], out: Path) -> dict[str, float]:
    """A `kvshare serve` of `tree` under the serving client: output tok/s and TTFT p50 (ms)."""
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    process = start_server(command, f"http://127.0.0.1:{port}/ready", cwd=tree)
    try:
        client = [sys.executable, "benchmarks/serving.py", "--base-url"]
        client += [f"http://127.0.0.1:{port}/v1", "--out", str(out), *client_args]
        subprocess.run(client, cwd=REPO, check=True, capture_output=True)
    finally:
        stop_server(process)
    summary = json.loads(out.read_text())["summary"]
    if summary["failed"] or summary["unfinished"]:
        raise RuntimeError(f"{tree}: {summary['failed']} failed, {summary['errors']}")
    return {
        "serving output tok/s": summary["output_token_throughput"],
        "serving TTFT p50 ms": 1000 * summary["ttft_s"]["p50"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the tree before the change")
    parser.add_argument("--after", type=Path, default=REPO, help="default: this tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--profile-args",
        default="--batches 1 8 --steps 16 --prefill-repeats 2 --http-batches",
        help="benchmarks/profile_step.py's arguments",
    )
    parser.add_argument(
        "--client-args",
        default="--workload shared-prefix --num-requests 32 --concurrency 8 --max-tokens 64",
        help="benchmarks/serving.py's arguments",
    )
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "figures.json"
        for number in range(args.rounds):
            order = list(trees) if number % 2 == 0 else list(reversed(trees))
            for name in order:
                found = profile(trees[name], args.profile_args.split(), out)
                found |= serve(trees[name], args.client_args.split(), out)
                for key, value in found.items():
                    figures[name].setdefault(key, []).append(value)
                print(f"round {number + 1} {name}: {found}", flush=True)
    print(f"\n| figure | before (median of {args.rounds}) | after | after / before |")
    print("|---|---|---|---|")
    for key, values in figures["before"].items():
        before, after = statistics.median(values), statistics.median(figures["after"][key])
        print(f"| {key} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
