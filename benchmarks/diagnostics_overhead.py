"""What cache diagnostics and fair share cost: shared-prefix throughput at concurrency 8, four
real servers side by side, in interleaved rounds (issues 24 and 26).

    before      the code before the diagnostics landed (the parent of the first commit that
                touched engine/kv/cache_diagnosis.py), exported with `git archive` into a
                temporary tree and served from there; scheduling fcfs (its only policy then)
    off         this tree, cache_diagnostics off (the default), scheduling fcfs
    on          this tree, every response diagnosed (server.cache_diagnostics true), fcfs
    fair-share  this tree, diagnostics off, scheduling fair-share (one tenant)

Every server is `python -m app.cli serve --config config/cpu.yaml` from its own tree with the
same flags (one API key, so the single tenant is a real tenant; --quantization fp16, whose code
is the same in both trees, so the weights path does not differ). All four load the model once
and stay up; each round runs benchmarks/serving.py's shared-prefix workload (one ~200-token
system prompt, a different short question each, `ignore_eos`) against each server in turn,
with a seed of its own per round (the same for every server): every round starts with a
system prompt no server has cached. The server order rotates from round to round.

Prints a Markdown table per server: output tok/s (median of the rounds, and each run), and the
server process's CPU time per output token (user + system, from /proc; Linux only), each
against `off` two ways: the ratio of the medians, and the median of the same-round ratios with
its interquartile range. On a shared 2-core host the wall-clock rate of one run moves by 10-20%
with the neighbours' load. A same-round ratio cancels the drift both servers saw; CPU time per
token tells a server that did more work from cores that ran slower (on an AVX-512 Xeon it moved
with the wall clock: the server kept both cores busy, so the spread came from the cores).

    python benchmarks/diagnostics_overhead.py --rounds 3 --requests 16 --max-tokens 32
    python benchmarks/diagnostics_overhead.py --quick      # a smoke run: 1 round, 4 requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.run_summary import summarize  # noqa: E402
from benchmarks.servers import free_port, proc_cpu_seconds, start_server, stop_server  # noqa: E402
from benchmarks.serving import BenchmarkConfig, run_benchmark  # noqa: E402

API_KEY = "diagnostics-overhead-key"
DIAGNOSIS_MODULE = "engine/kv/cache_diagnosis.py"
CONFIGS = ("before", "off", "on", "fair-share")
EXTRA_FLAGS = {
    "before": ("--scheduling-policy", "fcfs"),
    "off": ("--scheduling-policy", "fcfs"),
    "on": ("--scheduling-policy", "fcfs", "--cache-diagnostics", "true"),
    "fair-share": ("--scheduling-policy", "fair-share"),
}


@dataclass
class Server:
    name: str
    tree: Path
    base_url: str = ""
    pid: int = 0
    tok_s: list[float] = field(default_factory=list)
    cpu_ms_per_token: list[float] = field(default_factory=list)  # server CPU per output token
    num_failed: int = 0


def baseline_commit() -> str:
    """The parent of the first commit that touched the diagnosis module."""
    log = ["git", "-C", str(REPO), "log", "--format=%H", "--reverse", "--", DIAGNOSIS_MODULE]
    first = subprocess.run(log, capture_output=True, text=True, check=True).stdout.split()[0]
    parent = ["git", "-C", str(REPO), "rev-parse", f"{first}^"]
    return subprocess.run(parent, capture_output=True, text=True, check=True).stdout.strip()


def export_tree(commit: str, directory: Path) -> Path:
    """The files of `commit` under directory (git archive: no worktree, nothing in .git)."""
    archive = directory / "tree.tar"
    command = ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), commit]
    subprocess.run(command, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory / "tree", filter="data")
    archive.unlink()
    return directory / "tree"


def serve(server: Server, args: argparse.Namespace) -> subprocess.Popen:
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    command += ["--quantization", args.quantization, *EXTRA_FLAGS[server.name]]
    # Each server imports its own tree: cwd is first on sys.path, PYTHONPATH says it again.
    env = {"KVSHARE_API_KEYS": API_KEY, "PYTHONPATH": str(server.tree)}
    log = Path(tempfile.gettempdir()) / f"diagnostics_overhead_{server.name}_{port}.log"
    process = start_server(
        command, f"http://127.0.0.1:{port}/ready", cwd=server.tree, env=env, log=log
    )
    server.base_url = f"http://127.0.0.1:{port}/v1"
    server.pid = process.pid
    return process


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and of its waited-for children (/proc/PID/stat)."""
    return proc_cpu_seconds(Path(f"/proc/{pid}/stat"), children=True)


def serves_diagnostics(server: Server) -> bool:
    """Whether the server's code has the diagnostics (its /metrics names the miss reasons)."""
    metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", trust_env=False)
    return "kvshare_prefix_cache_miss_tokens_total" in metrics.text


def run_round(server: Server, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(output tok/s, the server's CPU ms per output token) of one run."""
    config = BenchmarkConfig(
        base_url=server.base_url, workload="shared-prefix", num_requests=args.requests,
        concurrency=args.concurrency, max_tokens=args.max_tokens, seed=seed, api_key=API_KEY,
        timeout_s=args.timeout,
    )  # fmt: skip
    cpu_before = cpu_seconds(server.pid)
    results, duration = asyncio.run(run_benchmark(config))
    cpu_spent = cpu_seconds(server.pid) - cpu_before
    summary = summarize(results, config.workload, config.num_requests, duration)
    server.num_failed += config.num_requests - summary.completed
    return summary.output_token_throughput, cpu_spent * 1e3 / max(1, summary.output_tokens)


def measure(servers: list[Server], args: argparse.Namespace) -> None:
    for server in servers:  # warm-up: the first requests of a process are slower
        run_round(server, args, seed=10_000)
    for round_index in range(args.rounds):
        # Interleaved, and each round starts with the next server: machine drift and the
        # position in a round spread over every server alike.
        shift = round_index % len(servers)
        for server in servers[shift:] + servers[:shift]:
            tok_s, cpu_ms = run_round(server, args, seed=round_index)
            server.tok_s.append(tok_s)
            server.cpu_ms_per_token.append(cpu_ms)
            print(
                f"round {round_index} {server.name}: {tok_s:.1f} tok/s, "
                f"{cpu_ms:.2f} CPU ms per token",
                file=sys.stderr,
            )


def paired(values: list[float], base: list[float]) -> str:
    """The median of the same-round ratios values / base - 1, with their interquartile range."""
    ratios = [value / reference - 1 for value, reference in zip(values, base, strict=True)]
    if len(ratios) < 2:
        return f"{ratios[0]:+.1%}"
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):+.1%} ({low:+.1%} .. {high:+.1%})"


def format_markdown(servers: list[Server], args: argparse.Namespace, commit: str) -> str:
    by_name = {server.name: server for server in servers}
    base = by_name.get("off")
    lines = [
        f"Shared-prefix workload, {args.requests} requests x {args.max_tokens} output tokens, "
        f"concurrency {args.concurrency}, --quantization {args.quantization}, one API key, "
        f"{args.rounds} interleaved rounds; before = {commit[:10]}. Against `off`: the ratio "
        "of the medians, then the median of the same-round ratios (interquartile range).",
        "",
        "| server | output tok/s (median) | vs off | same round | server CPU ms per token "
        "(median) | vs off | same round | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for server in servers:
        tok_s = statistics.median(server.tok_s)
        cpu_ms = statistics.median(server.cpu_ms_per_token)
        columns = [server.name, f"{tok_s:.1f}", "-", "-", f"{cpu_ms:.2f}", "-", "-"]
        if base is not None and server is not base:
            columns[2] = f"{tok_s / statistics.median(base.tok_s) - 1:+.1%}"
            columns[3] = paired(server.tok_s, base.tok_s)
            columns[5] = f"{cpu_ms / statistics.median(base.cpu_ms_per_token) - 1:+.1%}"
            columns[6] = paired(server.cpu_ms_per_token, base.cpu_ms_per_token)
        lines.append("| " + " | ".join([*columns, str(server.num_failed)]) + " |")
    lines += ["", "| server | runs (tok/s) | runs (server CPU ms per token) |", "|---|---|---|"]
    for server in servers:
        runs = ", ".join(f"{v:.1f}" for v in server.tok_s)
        cpu_runs = ", ".join(f"{v:.2f}" for v in server.cpu_ms_per_token)
        lines.append(f"| {server.name} | {runs} | {cpu_runs} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--quantization", default="fp16")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="a subset of " + str(CONFIGS))
    parser.add_argument("--baseline", default=None, help="commit for `before` (default: found)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument("--quick", action="store_true", help="smoke: 1 round, 4 requests x 4")
    parser.add_argument("--out", type=Path, default=None, help="also write the runs as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, 4, 4
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commit = args.baseline or baseline_commit()
    names = [name for name in CONFIGS if name in args.configs.split(",")]
    with (
        tempfile.TemporaryDirectory(prefix="diagnostics_overhead_") as scratch,
        ExitStack() as stack,
    ):
        scratch_dir = Path(scratch)
        before_tree = export_tree(commit, scratch_dir) if "before" in names else None
        servers = [Server(name, before_tree if name == "before" else REPO) for name in names]
        for server in servers:
            process = serve(server, args)
            stack.callback(stop_server, process)
            expected = server.name != "before"
            if serves_diagnostics(server) != expected:
                raise RuntimeError(f"{server.name} does not serve the code it should")
        measure(servers, args)
    table = format_markdown(servers, args, commit)
    if args.out is not None:
        runs = {server.name: server.tok_s for server in servers}
        cpu = {server.name: server.cpu_ms_per_token for server in servers}
        record = {"baseline": commit, "tok_s": runs, "server_cpu_ms_per_token": cpu}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
