"""Bounded soak: minutes of mixed traffic with client disconnects against a real `kvshare serve`.

Starts `kvshare serve` (config/cpu.yaml, the embedded default model, a small --max-model-len so
that prompts near the context limit stay cheap) on a free loopback port and keeps --concurrency
clients busy for --minutes with a random mix of: streamed and non-streamed chat and completions,
n > 1, stop strings, seeded sampling, structured outputs (response_format json_schema), prompts
near and just over the context limit (the latter must get a 400), and client disconnects at
random points: before the first token, mid-stream, during the prefill of a long prompt, and
during a non-streamed request.

Every --sample-seconds it records the server's RSS (psutil) and its /metrics: KV blocks by
state, kvshare_kv_blocks_leaked, running and waiting requests. At the end it waits for the
engine to go idle and checks that nothing is held (no running request, no private or shared
block). It writes a JSON record and a PNG plot of RSS and block states over time, and prints a
table: requests by outcome, disconnects, 5xx, leaked max, RSS start/end and the RSS slope after
warm-up (least squares, MB/hour).

    python benchmarks/soak.py --minutes 20 --out benchmarks/results/soak

Goals: 0 5xx, leaked 0 throughout, nothing held at the end, slope < 20 MB/hour. It talks only
to 127.0.0.1 and is never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.servers import free_port, start_server, stop_server  # noqa: E402
from benchmarks.soak_traffic import Traffic  # noqa: E402

_SAMPLE = re.compile(r"^(?P<key>[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?)\s+(?P<value>\S+)$")
STATE_COLORS = {"free": "tab:blue", "private": "tab:orange", "shared": "tab:green"}
STATE_COLORS["cached"] = "tab:purple"
STATES = tuple(STATE_COLORS)  # the block states /metrics reports


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    blocks: dict[str, float]
    leaked: float
    running: float
    waiting: float


@dataclass
class Record:
    concurrency: int
    minutes: float
    max_model_len: int
    outcomes: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)  # "kind: outcome" -> count
    samples: list[Sample] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)


# -- the server -------------------------------------------------------------------------
def server_command(port: int, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    command += ["--max-model-len", str(args.max_model_len)]
    command += ["--num-kv-blocks", str(args.num_kv_blocks), "--num-threads", str(args.num_threads)]
    return command


def rss_mb(process: psutil.Process) -> float:
    """Resident memory of the server and any children it started, in MB."""
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # it may exit between the calls
            total += child.memory_info().rss
    return total / 1e6


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics", timeout=10.0)).text
    metrics = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            metrics[match["key"]] = float(match["value"])
    return metrics


async def take_sample(http: httpx.AsyncClient, process: psutil.Process, t0: float) -> Sample:
    metrics = await scrape(http)
    return Sample(
        t_s=time.monotonic() - t0,
        rss_mb=rss_mb(process),
        blocks={s: metrics.get(f'kvshare_kv_blocks{{state="{s}"}}', 0.0) for s in STATES},
        leaked=metrics.get("kvshare_kv_blocks_leaked", 0.0),
        running=metrics.get('kvshare_requests{state="running"}', 0.0),
        waiting=metrics.get('kvshare_requests{state="waiting"}', 0.0),
    )


# -- the run --------------------------------------------------------------------------------
async def client_loop(traffic: Traffic, deadline: float, record: Record) -> None:
    while time.monotonic() < deadline:
        kind, outcome = await traffic.one()
        record.outcomes[outcome] += 1
        record.by_kind[f"{kind}: {outcome}"] += 1


async def sampler(http, process, t0: float, stop: asyncio.Event, every_s: float, record) -> None:
    while not stop.is_set():
        record.samples.append(await take_sample(http, process, t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)


async def soak(base_url: str, server: psutil.Process, args: argparse.Namespace) -> Record:
    """Run the clients until the deadline, then wait for the engine to go idle."""
    record = Record(args.concurrency, args.minutes, args.max_model_len)
    # The monitor has its own client: cut connections never delay a sample.
    async with (
        httpx.AsyncClient(base_url=f"{base_url}/v1", timeout=args.client_timeout) as http,
        httpx.AsyncClient(base_url=base_url, timeout=30.0) as monitor,
    ):
        t0 = time.monotonic()
        stop = asyncio.Event()
        watch = asyncio.create_task(sampler(monitor, server, t0, stop, args.sample_seconds, record))
        deadline = t0 + args.minutes * 60
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
        clients = [Traffic(http, rng, args.max_model_len) for rng in rngs]
        await asyncio.gather(*(client_loop(c, deadline, record) for c in clients))
        record.final = await wait_idle(monitor, timeout_s=60.0)
        stop.set()
        await watch
        record.samples.append(await take_sample(monitor, server, t0))
        record.final["health"] = float((await monitor.get("/health")).status_code)
    return record


async def wait_idle(http: httpx.AsyncClient, timeout_s: float) -> dict[str, float]:
    """Poll until no request runs or waits (aborts of cut connections land within a step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await scrape(http)
        busy = (
            metrics['kvshare_requests{state="running"}']
            + metrics['kvshare_requests{state="waiting"}']
        )
        if busy == 0 or time.monotonic() > deadline:
            keys = [f'kvshare_kv_blocks{{state="{s}"}}' for s in STATES]
            keys += ["kvshare_kv_blocks_leaked", 'kvshare_requests{state="running"}']
            keys += ['kvshare_requests{state="waiting"}', "kvshare_kv_evictions_total"]
            return {key: metrics.get(key, float("nan")) for key in keys}
        await asyncio.sleep(0.5)


# -- the report -------------------------------------------------------------------------------
def rss_slope_mb_per_hour(samples: list[Sample], warmup_s: float) -> float:
    """Least-squares slope of RSS over time after warm-up, in MB per hour."""
    points = [(s.t_s / 3600, s.rss_mb) for s in samples if s.t_s >= warmup_s]
    if len(points) < 3:
        return float("nan")
    mean_t = sum(t for t, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (m - mean_m) for t, m in points) / var_t


def summary(record: Record, warmup_s: float) -> dict:
    outcomes = record.outcomes
    samples = record.samples
    final = record.final
    return {
        "concurrency": record.concurrency,
        "minutes": record.minutes,
        "max_model_len": record.max_model_len,
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes.most_common()),
        "by_kind": dict(sorted(record.by_kind.items())),
        "disconnects": sum(n for k, n in outcomes.items() if k.startswith("disconnect")),
        "num_5xx": outcomes.get("5xx", 0),
        "leaked_max": max(s.leaked for s in samples),
        "held_at_end": {
            "running": final['kvshare_requests{state="running"}'],
            "waiting": final['kvshare_requests{state="waiting"}'],
            "private_blocks": final['kvshare_kv_blocks{state="private"}'],
            "shared_blocks": final['kvshare_kv_blocks{state="shared"}'],
        },
        "health_after": final["health"],
        "rss_start_mb": samples[0].rss_mb,
        "rss_end_mb": samples[-1].rss_mb,
        "warmup_s": warmup_s,
        "rss_slope_mb_per_hour": rss_slope_mb_per_hour(samples, warmup_s),
    }


def print_table(report: dict) -> None:
    held = report["held_at_end"]
    rows = [
        ("duration, concurrency", f"{report['minutes']} min, {report['concurrency']} clients"),
        ("requests", report["requests"]),
        *((f"  {name}", count) for name, count in report["outcomes"].items()),
        ("disconnects", report["disconnects"]),
        ("5xx", report["num_5xx"]),
        ("kvshare_kv_blocks_leaked, max", int(report["leaked_max"])),
        (
            "held at end (running, waiting, private, shared)",
            ", ".join(
                str(int(held[k])) for k in ("running", "waiting", "private_blocks", "shared_blocks")
            ),
        ),
        ("RSS start / end (MB)", f"{report['rss_start_mb']:.0f} / {report['rss_end_mb']:.0f}"),
        (
            f"RSS slope after {report['warmup_s']:.0f} s warm-up (MB/hour)",
            f"{report['rss_slope_mb_per_hour']:.1f}",
        ),
    ]
    print("| figure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


def plot(record: Record, warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in record.samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(minutes, [s.rss_mb for s in record.samples], color="black")
    top.set_ylabel("server RSS (MB)")
    top.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    top.legend(loc="lower right")
    for state, color in STATE_COLORS.items():
        blocks = [s.blocks[state] for s in record.samples]
        bottom.plot(minutes, blocks, label=state, color=color)
    leaked = [s.leaked for s in record.samples]
    bottom.plot(minutes, leaked, label="leaked", color="red", linestyle="--")
    bottom.set_ylabel("KV blocks")
    bottom.set_xlabel("minutes")
    bottom.legend(loc="center right", ncol=5, fontsize="small")
    fig.suptitle(f"kvshare soak: {record.concurrency} clients, mixed traffic with disconnects")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    # Small enough that the cache fills and evicts (a full-length sequence takes 64 blocks).
    parser.add_argument("--num-kv-blocks", type=int, default=320)
    parser.add_argument("--sample-seconds", type=float, default=2.0)
    # One torch thread: on a shared machine two OpenMP threads spin against the neighbours.
    parser.add_argument("--num-threads", type=int, default=1)
    # A request slower than this is cut by the client (counted: "client error ReadTimeout").
    parser.add_argument("--client-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/soak", help="path stem: .json .png")
    args = parser.parse_args()
    warmup_s = max(60.0, 0.2 * args.minutes * 60)
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"kvshare-soak-{port}.log"
    base_url = f"http://127.0.0.1:{port}"
    # The log is a file, not a pipe: a full pipe would stall the server.
    command = server_command(port, args)
    process = start_server(command, f"{base_url}/ready", cwd=REPO_ROOT, log=log_path)
    try:
        record = asyncio.run(soak(base_url, psutil.Process(process.pid), args))
    finally:
        stop_server(process, timeout_s=30)
    report = summary(record, warmup_s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = [asdict(s) for s in record.samples]
    out.with_suffix(".json").write_text(json.dumps({**report, "samples": samples}, indent=1))
    plot(record, warmup_s, out.with_suffix(".png"))
    print_table(report)
    print(f"server log: {log_path}; wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
