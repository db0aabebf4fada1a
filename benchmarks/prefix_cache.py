"""Prefix cache on vs off: the serving benchmark against two kvshare servers, in one run.

It starts `kvshare serve` twice, with the prefix cache on and with `--no-prefix-cache`, warms
both up, and runs each workload of benchmarks/serving.py on the first, then on the second: one
server works at a time, and each pair is measured back to back. The issue's goals:

  shared-prefix: TTFT p50 with the cache <= 0.5x without; output throughput >= 1.25x
  multi-turn:    >= 70% of prompt tokens served from the cache

    python benchmarks/prefix_cache.py --num-requests 64 --concurrency 8 --max-tokens 128 \
        --server-args "--num-threads 1" --out benchmarks/results/prefix_cache.json

(`--num-threads 1` keeps a shared CPU machine's other jobs from stalling the servers' OpenMP
threads; see benchmarks/README.md.)

Prints a Markdown table and writes every summary and request record as JSON. Exit status 0
when every request completed (goals missed are reported, not an error), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run_summary import Summary, summarize
from benchmarks.servers import running_kvshare
from benchmarks.serving import BenchmarkConfig, RequestResult, report_json, run_benchmark

MODES = {"on": (), "off": ("--no-prefix-cache",)}  # server flags per cache mode
WORKLOADS = ("shared-prefix", "multi-turn")
TTFT_GOAL = 0.5  # shared-prefix: TTFT p50 on / off at most this
THROUGHPUT_GOAL = 1.25  # shared-prefix: output throughput on / off at least this
CACHED_FRACTION_GOAL = 0.70  # multi-turn: prompt tokens served from the cache at least this


@dataclass
class Run:
    """One workload against one server."""

    mode: str  # "on" | "off"
    config: BenchmarkConfig
    summary: Summary
    results: list[RequestResult]


@dataclass
class Row:
    """One line of the comparison table; `goal` is None for context-only rows."""

    workload: str
    metric: str
    on: str
    off: str
    ratio: str
    goal: str | None = None
    met: bool | None = None


# ---------------------------------------------------------------- running


def warm_up(base_url: str) -> None:
    """One short completion (no chat template, so no block shared with the workloads)."""
    body = {"prompt": "Warm-up request.", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300.0)
    response.raise_for_status()


def run_workload(mode: str, base_url: str, config: BenchmarkConfig) -> Run:
    config = BenchmarkConfig(**{**asdict(config), "base_url": f"{base_url}/v1"})
    print(f"cache {mode}: {config.workload} ...", file=sys.stderr, flush=True)
    results, duration_s = asyncio.run(run_benchmark(config))
    summary = summarize(results, config.workload, config.num_requests, duration_s)
    run = Run(mode, config, summary, results)
    print(f"  {_describe(run)}", file=sys.stderr, flush=True)
    return run


def measure(server_flags: list[str], configs: list[BenchmarkConfig]) -> dict[str, list[Run]]:
    """Both servers up; each workload runs on the cache-on one, then on the cache-off one.

    An idle server uses no CPU (its engine thread blocks), so the pair measured back to back
    sees the same machine even when its load drifts over the run.
    """
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    with (
        running_kvshare(*server_flags, *MODES["on"]) as on_url,
        running_kvshare(*server_flags, *MODES["off"]) as off_url,
    ):
        urls = {"on": on_url, "off": off_url}
        for url in urls.values():
            warm_up(url)
        for config in configs:
            for mode, url in urls.items():
                runs[mode].append(run_workload(mode, url, config))
    return runs


# ---------------------------------------------------------------- comparing


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def _ttft_p50(summary: Summary) -> float | None:
    return summary.ttft_s.p50 if summary.ttft_s else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def compare(workload: str, on: Summary, off: Summary) -> list[Row]:
    """TTFT p50, output throughput and cached fraction, with the goals that apply here."""
    ttft = _ratio(_ttft_p50(on), _ttft_p50(off))
    throughput = _ratio(on.output_token_throughput, off.output_token_throughput)
    is_shared = workload == "shared-prefix"
    is_multi_turn = workload == "multi-turn"
    return [
        Row(
            workload,
            "TTFT p50 (ms)",
            _ms(_ttft_p50(on)),
            _ms(_ttft_p50(off)),
            _times(ttft),
            f"<= {TTFT_GOAL}x" if is_shared else None,
            (ttft is not None and ttft <= TTFT_GOAL) if is_shared else None,
        ),
        Row(
            workload,
            "output throughput (tok/s)",
            f"{on.output_token_throughput:.1f}",
            f"{off.output_token_throughput:.1f}",
            _times(throughput),
            f">= {THROUGHPUT_GOAL}x" if is_shared else None,
            (throughput is not None and throughput >= THROUGHPUT_GOAL) if is_shared else None,
        ),
        Row(
            workload,
            "prompt tokens from the cache",
            f"{on.cached_fraction:.1%}",
            f"{off.cached_fraction:.1%}",
            "-",
            f">= {CACHED_FRACTION_GOAL:.0%}" if is_multi_turn else None,
            on.cached_fraction >= CACHED_FRACTION_GOAL if is_multi_turn else None,
        ),
    ]


def format_table(rows: list[Row], on: list[Run], off: list[Run]) -> str:
    lines = [
        "| workload | metric | cache on | cache off | on / off | goal | met |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "no")
        cells = [row.workload, row.metric, row.on, row.off, row.ratio, row.goal or "-", met]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(f"- {_describe(run)}" for run in on + off)
    return "\n".join(lines)


def _describe(run: Run) -> str:
    s = run.summary
    return (
        f"cache {run.mode}, {s.workload}: {s.completed}/{s.num_requests} completed, "
        f"{s.failed} failed, {s.unfinished} unfinished, {s.duration_s:.1f} s, "
        f"{s.prompt_tokens} prompt / {s.cached_tokens} cached / {s.output_tokens} output tokens"
    )


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="limit per workload run (s)")
    parser.add_argument("--config", default="config/cpu.yaml", help="server settings YAML")
    parser.add_argument(
        "--server-args", default="", help='more `kvshare serve` flags, e.g. "--max-num-seqs 16"'
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if min(args.num_requests, args.concurrency, args.max_tokens) < 1 or args.timeout <= 0:
        parser.error("--num-requests, --concurrency, --max-tokens and --timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [
        BenchmarkConfig(
            workload=workload,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            seed=args.seed,
            timeout_s=args.timeout,
        )
        for workload in args.workloads
    ]
    server_flags = ["--config", args.config, *shlex.split(args.server_args)]
    started = time.perf_counter()
    runs = measure(server_flags, configs)
    on, off = runs["on"], runs["off"]
    rows = [
        row
        for run_on, run_off in zip(on, off, strict=True)
        for row in compare(run_on.config.workload, run_on.summary, run_off.summary)
    ]
    print(format_table(rows, on, off))
    print(f"\ntotal wall time: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.out is not None:
        report = {
            "server_flags": server_flags,
            "comparison": [asdict(row) for row in rows],
            "runs": [
                {"cache": run.mode, **report_json(run.config, run.summary, run.results)}
                for run in on + off
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    completed = all(run.summary.completed == run.summary.num_requests for run in on + off)
    return 0 if completed else 1


if __name__ == "__main__":
    sys.exit(main())
