"""Two-replica drill: kvshare replicas behind the SGLang Model Gateway, against one replica alone.

Starts two `kvshare serve` replicas (--num-threads 1 each) on free loopback ports and the SGLang
Model Gateway (sglang-router, installed into this venv when missing) in front of them, first
with --policy cache_aware, then with --policy round_robin; and one replica alone with
--num-threads 2 (the same cores in total) as the baseline. Through each of them it runs the
multi-turn and many-system-prompts workloads of benchmarks/serving.py and reports, per policy
and workload: the cluster-wide prefix-cache hit rate (sum over the replicas of the
kvshare_prefix_cache_hits_total / kvshare_prefix_cache_queries_total deltas of their
/metrics), the blocks their prefix caches evicted, TTFT p50/p99 and output tokens per second.

    python benchmarks/replicas.py --out benchmarks/results/replicas.json

Rounds interleave the three targets (cache_aware, round_robin, single), so that drift in the
machine's load hits all alike; the replicas stay up across policies and every (round, target,
workload) has its own seed, so no run finds an earlier one's prompts cached. Everything is
bounded (few requests, short outputs, a time limit per run), talks only to 127.0.0.1 and is
never part of `make test`.

Users pause before each later turn (--think-time, exponential, mean 1 s): without pauses
round-robin would send every turn of a conversation to the same replica by accident of the
order. One drill per KV pool in --kv-blocks-per-replica (fresh replicas each time): 'config'
(ample here), or N blocks per replica and 2N for the single baseline (the same cores and KV
memory in total), a fleet whose histories outgrow a replica's pool; history_blocks, the full
KV blocks the multi-turn histories leave, is what to set N against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import serving  # the project's serving client
from benchmarks.replicas_report import (
    POLICIES,
    TARGETS,
    WORKLOADS,
    Run,
    aggregate,
    block_size_in,
    counters,
    format_table,
    goal,
    history_blocks,
    pool_label,
)
from benchmarks.run_summary import Summary, summarize
from benchmarks.servers import free_port
from benchmarks.serving import RequestResult

ROUTER_PACKAGE = "sglang-router"
ROUTER_VERSION = "0.3.2"
# KV pool per replica in blocks, one drill each (None: the config's pool, ample here).
DEFAULT_POOLS = (None, 150, 100, 75)
REPO_ROOT = Path(__file__).resolve().parent.parent
SGLANG_PROBES = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")


@dataclass
class DrillConfig:
    num_requests: dict[str, int]  # per workload
    concurrency: int = 4
    max_tokens: int = 16
    think_time_s: float = 0.0  # mean pause of a user before each later turn (serving.py)
    rounds: int = 2
    timeout_s: float = 150.0  # per (round, target, workload) run
    startup_timeout_s: float = 300.0
    seed: int = 0
    config_path: str = "config/cpu.yaml"
    # KV pool of each replica in blocks, one drill per entry (None: the config's pool); the
    # single baseline gets twice a set pool.
    pools: list[int | None] = field(default_factory=lambda: list(DEFAULT_POOLS))
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvshare-drill-")))


# ---------------------------------------------------------------- processes


def ensure_router() -> None:
    """Installs sglang-router==0.3.2 into this interpreter's environment when it is missing."""
    check = "import importlib.metadata as m; print(m.version('sglang-router'))"
    found = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if found.returncode == 0 and found.stdout.strip() == ROUTER_VERSION:
        return
    print(f"installing {ROUTER_PACKAGE}=={ROUTER_VERSION} into {sys.prefix}", file=sys.stderr)
    pip = [sys.executable, "-m", "pip", "install", "-q", f"{ROUTER_PACKAGE}=={ROUTER_VERSION}"]
    subprocess.run(pip, check=True)


@contextlib.contextmanager
def process(argv: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """A child process logging to log_path; terminated (then killed) on the way out."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            yield child
        finally:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def replica_argv(
    port: int, num_threads: int, config_path: str, num_kv_blocks: int | None = None
) -> list[str]:
    kvshare = Path(sys.executable).parent / "kvshare"
    pool = [] if num_kv_blocks is None else ["--num-kv-blocks", str(num_kv_blocks)]
    return [str(kvshare), "serve", "--config", config_path, "--host", "127.0.0.1",
            "--port", str(port), "--num-threads", str(num_threads), *pool]  # fmt: skip


def gateway_argv(port: int, worker_urls: list[str], policy: str) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn",
            "--worker-urls", *worker_urls]  # fmt: skip


def wait_until(check, timeout_s: float, what: str, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{what} exited with status {child.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s")


def replica_is_ready(url: str) -> bool:
    return httpx.get(f"{url}/ready", timeout=5, trust_env=False).status_code == 200


def gateway_serves(url: str, model: str) -> bool:
    """A one-token chat through the gateway succeeds (its workers are registered)."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, trust_env=False)
    return response.status_code == 200


# ---------------------------------------------------------------- measuring


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text


def run_workload(
    drill: DrillConfig, base_url: str, model: str, workload: str, seed: int
) -> tuple[Summary, list[RequestResult]]:
    config = serving.BenchmarkConfig(
        base_url=f"{base_url}/v1",
        model=model,
        workload=workload,
        num_requests=drill.num_requests[workload],
        concurrency=drill.concurrency,
        max_tokens=drill.max_tokens,
        think_time_s=drill.think_time_s,
        seed=seed,
        timeout_s=drill.timeout_s,
    )
    results, duration_s = asyncio.run(serving.run_benchmark(config))
    return summarize(results, workload, config.num_requests, duration_s), results


def measure(
    drill: DrillConfig,
    target: tuple[str, str, list[str]],
    model: str,
    workload: str,
    round_index: int,
    pool: int | None,
) -> Run:
    """Runs one workload through target (name, base URL, replica URLs) and reads the deltas."""
    name, base_url, replica_urls = target
    seed = (
        drill.seed + 1000 * (round_index + 1) + 10 * TARGETS.index(name) + WORKLOADS.index(workload)
    )
    before = [counters(scrape(url)) for url in replica_urls]
    summary, results = run_workload(drill, base_url, model, workload, seed)
    after_texts = [scrape(url) for url in replica_urls]
    after = [counters(text) for text in after_texts]
    deltas = [
        tuple(x - y for x, y in zip(a, b, strict=True)) for a, b in zip(after, before, strict=True)
    ]
    ttft = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    block_size = block_size_in(after_texts[0])
    return Run(
        pool=pool,
        round=round_index,
        target=name,
        workload=workload,
        seed=seed,
        hits=sum(d[0] for d in deltas),
        queries=sum(d[1] for d in deltas),
        per_replica_queries=[d[1] for d in deltas],
        evicted_blocks=int(sum(d[2] for d in deltas)),
        history_blocks=history_blocks(results, block_size),
        summary=asdict(summary),
        ttft_s=ttft,
    )


# ---------------------------------------------------------------- the drill


def probes_seen(log_path: Path) -> dict[str, int]:
    """How often the replica's access log shows each SGLang-only probe of the gateway."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {path: len(re.findall(re.escape(path) + r"(?!\w)", text)) for path in SGLANG_PROBES}


def start_replicas(
    drill: DrillConfig, pool: int | None, log_dir: Path, stack: contextlib.ExitStack
) -> list[str]:
    """Replicas a and b (1 thread each) and the single baseline (2 threads, twice the KV pool
    when the pool is set); their URLs.

    All three start at once (they load the model in parallel), then each is waited for.
    """
    started = []
    for name, num_threads in (("replica-a", 1), ("replica-b", 1), ("single", 2)):
        port = free_port()
        num_kv_blocks = None if pool is None else pool * (2 if name == "single" else 1)
        argv = replica_argv(port, num_threads, drill.config_path, num_kv_blocks)
        child = stack.enter_context(process(argv, log_dir / f"{name}.log"))
        started.append((name, f"http://127.0.0.1:{port}", child))
    for name, url, child in started:
        wait_until(lambda u=url: replica_is_ready(u), drill.startup_timeout_s, name, child)
    return [url for _, url, _ in started]


def through_gateway(
    drill: DrillConfig,
    policy: str,
    replica_urls: list[str],
    model: str,
    round_index: int,
    pool: int | None,
    log_dir: Path,
) -> tuple[list[Run], dict]:
    """Starts the gateway with `policy` in front of the replicas, runs every workload, stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"gateway-{policy}-{round_index}.log"
    with process(gateway_argv(port, replica_urls, policy), log) as gateway:
        wait_until(lambda: gateway_serves(url, model), drill.startup_timeout_s, policy, gateway)
        listing = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()
        target = (policy, url, replica_urls)
        runs = [measure(drill, target, model, w, round_index, pool) for w in WORKLOADS]
    return runs, {"v1_models": listing}


def drill_one_pool(drill: DrillConfig, pool: int | None) -> tuple[list[Run], dict, str]:
    """Fresh replicas with this pool; the rounds interleave cache_aware, round_robin, single."""
    log_dir = drill.log_dir / ("config-pool" if pool is None else f"pool-{pool}")
    runs: list[Run] = []
    gateway_info: dict = {}
    with contextlib.ExitStack() as stack:
        *replica_urls, single_url = start_replicas(drill, pool, log_dir, stack)
        models = httpx.get(f"{single_url}/v1/models", timeout=10, trust_env=False).json()
        model = models["data"][0]["id"]
        for round_index in range(drill.rounds):
            for policy in POLICIES:
                policy_runs, gateway_info[policy] = through_gateway(
                    drill, policy, replica_urls, model, round_index, pool, log_dir
                )
                runs.extend(policy_runs)
            single = ("single", single_url, [single_url])
            runs.extend(measure(drill, single, model, w, round_index, pool) for w in WORKLOADS)
            print(
                f"{pool_label(pool)}: round {round_index + 1}/{drill.rounds} done", file=sys.stderr
            )
    gateway_info["sglang_probes_seen_by_replica_a"] = probes_seen(log_dir / "replica-a.log")
    return runs, gateway_info, model


def run_drill(drill: DrillConfig) -> dict:
    ensure_router()
    runs: list[Run] = []
    pools: list[dict] = []
    gateway_info: dict = {}
    model = ""
    for pool in drill.pools:
        pool_runs, gateway_info, model = drill_one_pool(drill, pool)
        runs.extend(pool_runs)
        rows = aggregate(pool_runs)
        pools.append({"kv_blocks_per_replica": pool, "rows": rows, "goal": goal(rows)})
    return {
        "config": {**asdict(drill), "log_dir": str(drill.log_dir)},
        "model": model,
        "router": f"{ROUTER_PACKAGE}=={ROUTER_VERSION}",
        "pools": pools,
        "gateway": gateway_info,  # of the last pool's replicas
        "runs": [asdict(r) for r in runs],
    }


def parse_pool(text: str) -> int | None:
    """'config' (the config's pool) or a positive number of blocks."""
    if text == "config":
        return None
    try:
        blocks = int(text)
    except ValueError:
        blocks = 0
    if blocks < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'config' nor a positive integer")
    return blocks


def parse_args(argv: list[str] | None = None) -> tuple[DrillConfig, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multi-turn-requests", type=int, default=48, help="4 turns each")
    parser.add_argument("--system-prompt-requests", type=int, default=24, help="8 prompts")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--think-time", type=float, default=1.0, help="mean seconds before a later turn"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--timeout", type=float, default=150.0, help="limit per run (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="config/cpu.yaml", help="replica config")
    parser.add_argument(
        "--kv-blocks-per-replica",
        type=parse_pool,
        nargs="+",
        default=list(DEFAULT_POOLS),
        metavar="BLOCKS",
        help="KV pool of each replica, one drill per value: 'config' or blocks (the single gets "
        "twice); default: config 150 100 75",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    counts = (args.multi_turn_requests, args.system_prompt_requests, args.concurrency)
    if min(*counts, args.max_tokens, args.rounds) < 1 or args.timeout <= 0:
        parser.error("counts, --max-tokens, --rounds and --timeout must be positive")
    if args.think_time < 0:
        parser.error("--think-time must not be negative")
    drill = DrillConfig(
        num_requests={
            "multi-turn": args.multi_turn_requests,
            "many-system-prompts": args.system_prompt_requests,
        },
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        think_time_s=args.think_time,
        rounds=args.rounds,
        timeout_s=args.timeout,
        seed=args.seed,
        config_path=args.config,
        pools=args.kv_blocks_per_replica,
    )
    if args.log_dir is not None:
        drill.log_dir = args.log_dir
    return drill, args.out


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every run completed every request, 1 otherwise."""
    drill, out = parse_args(argv)
    started = time.monotonic()
    report = run_drill(drill)
    report["wall_s"] = time.monotonic() - started
    for pool in report["pools"]:
        print(format_table(pool["rows"], pool["goal"], pool["kv_blocks_per_replica"]) + "\n")
    print(f"{drill.rounds} round(s) per pool, {report['wall_s']:.0f}s wall", file=sys.stderr)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    complete = all(r["completed"] == r["planned"] for p in report["pools"] for r in p["rows"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
