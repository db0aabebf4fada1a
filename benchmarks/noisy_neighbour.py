"""Noisy-neighbour benchmark: does one tenant's flood slow another tenant's short requests?

Two API keys (two tenants) on one `kvshare serve` (config/cpu.yaml, the embedded model), once
per scheduling policy (fcfs, then fair-share), all on 127.0.0.1:

1. alone: tenant B sends one short request at a time; its TTFT p50 / p99.
2. flood: tenant A floods (--flood-concurrency requests in flight, unique ~1,000-token
   prompts) while B goes on as in 1; B's TTFT p50 / p99, and the output tokens each got.
3. equal demand: A and B each keep --equal-concurrency unique ~200-token prompts in flight; each
   tenant's share of the output tokens streamed in the window.
4. single tenant: benchmarks/serving.py's shared-prefix workload at concurrency 8 with key A
   alone; output-token throughput (what the policy costs with one tenant).

Output tokens are counted as they stream (content chunks), those of requests still running
when a phase ends included.

    python benchmarks/noisy_neighbour.py --out benchmarks/results/noisy_neighbour.json

Bounded: each phase lasts at most its --*-seconds, requests still running then are cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.run_summary import percentile, summarize
from benchmarks.servers import free_port, start_server, stop_server
from benchmarks.serving import (
    BenchmarkConfig,
    RequestResult,
    discover_model,
    run_benchmark,
    stream_chat,
)

REPO = Path(__file__).resolve().parent.parent
KEYS = ("tenant-a-key", "tenant-b-key")
FLOOD_WORDS = 900  # about 1,000 prompt tokens with the chat template
EQUAL_WORDS = 150  # equal demand: shorter prompts, so requests finish inside the window
SHORT_MAX_TOKENS = 2  # tenant B: its TTFT is the figure; the second token ends it
_WORDS = ("order", "refund", "parcel", "window", "label", "carrier", "invoice", "account")


@dataclass
class Phase:
    b_ttft_s: list[float] = field(default_factory=list)
    output_tokens: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        ttft = self.b_ttft_s
        shares = self.output_tokens
        total = sum(shares.values()) or 1
        return {
            "b_requests": len(ttft),
            "b_ttft_p50_ms": round(1000 * percentile(ttft, 50), 1) if ttft else None,
            "b_ttft_p99_ms": round(1000 * percentile(ttft, 99), 1) if ttft else None,
            "output_tokens": dict(shares),
            "output_share": {t: round(n / total, 3) for t, n in shares.items()},
            "errors": self.errors[:3],
        }


def unique_prompt(rng: random.Random, num_words: int) -> str:
    return f"{rng.getrandbits(64):016x} " + " ".join(rng.choices(_WORDS, k=num_words))


async def one_request(client, url, model, content, max_tokens, phase, tenant) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    token_times: list[float] = []
    try:
        result = await stream_chat(client, url, body, RequestResult(0, 0), token_times)
    finally:  # the tokens streamed count, also those of a request the phase's end cancels
        phase.output_tokens[tenant] += len(token_times)
    if not result.ok:
        phase.errors.append(f"{tenant}: {result.error}")
    return result


async def tenant_loop(base, key, tenant, concurrency, prompt, max_tokens, phase, ttft=None):
    """`concurrency` workers, each sending one request after another until cancelled."""
    url = f"{base}/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=600.0, trust_env=False, headers=headers) as client:
        model = await discover_model(client, base)

        async def worker() -> None:
            while True:
                result = await one_request(client, url, model, prompt(), max_tokens, phase, tenant)
                if ttft is not None and result.ok and result.ttft_s is not None:
                    ttft.append(result.ttft_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def timed(seconds: float, *loops) -> None:
    tasks = [asyncio.create_task(loop) for loop in loops]
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_policy(base: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    short = lambda: f"{rng.getrandbits(32):08x} What is a refund window?"  # noqa: E731
    flood = lambda: unique_prompt(rng, FLOOD_WORDS)  # noqa: E731
    medium = lambda: unique_prompt(rng, EQUAL_WORDS)  # noqa: E731
    a, b = KEYS
    alone, flooded, equal = Phase(), Phase(), Phase()
    b_alone = tenant_loop(base, b, "B", 1, short, SHORT_MAX_TOKENS, alone, alone.b_ttft_s)
    await timed(args.alone_seconds, b_alone)
    await timed(
        args.flood_seconds,
        tenant_loop(base, a, "A", args.flood_concurrency, flood, args.flood_max_tokens, flooded),
        tenant_loop(base, b, "B", 1, short, SHORT_MAX_TOKENS, flooded, flooded.b_ttft_s),
    )
    await asyncio.sleep(args.drain_seconds)  # the cancelled flood drains before the next phase
    await timed(
        args.equal_seconds,
        tenant_loop(base, a, "A", args.equal_concurrency, medium, 16, equal),
        tenant_loop(base, b, "B", args.equal_concurrency, medium, 16, equal),
    )
    await asyncio.sleep(args.drain_seconds)
    config = BenchmarkConfig(
        base_url=base, workload="shared-prefix", num_requests=args.single_requests,
        concurrency=8, max_tokens=32, api_key=a, timeout_s=args.single_seconds,
    )  # fmt: skip
    results, duration = await run_benchmark(config)
    single = summarize(results, config.workload, config.num_requests, duration)
    return {
        "alone": alone.summary(),
        "flood": flooded.summary(),
        "equal_demand": equal.summary(),
        "single_tenant_shared_prefix_c8": {
            "completed": single.completed,
            "output_token_throughput": round(single.output_token_throughput, 2),
            "duration_s": round(duration, 1),
        },
    }


def serve(policy: str, port: int, log: Path) -> object:
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    command += ["--scheduling-policy", policy]
    env = {"KVSHARE_API_KEYS": ",".join(KEYS)}
    return start_server(command, f"http://127.0.0.1:{port}/ready", cwd=REPO, env=env, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="fcfs,fair-share")
    parser.add_argument("--alone-seconds", type=float, default=15.0)
    parser.add_argument("--flood-seconds", type=float, default=45.0)
    parser.add_argument("--flood-concurrency", type=int, default=16)
    parser.add_argument("--flood-max-tokens", type=int, default=16)
    parser.add_argument("--equal-seconds", type=float, default=30.0)
    parser.add_argument("--equal-concurrency", type=int, default=4)
    parser.add_argument("--drain-seconds", type=float, default=10.0)
    parser.add_argument("--single-requests", type=int, default=16)
    parser.add_argument("--single-seconds", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = {"config": {k: str(v) for k, v in vars(args).items()}, "policies": {}}
    for policy in args.policies.split(","):
        port = free_port()
        log = Path(f"/tmp/noisy_neighbour_{policy}_{port}.log")
        process = serve(policy, port, log)
        try:
            started = time.perf_counter()
            result = asyncio.run(run_policy(f"http://127.0.0.1:{port}/v1", args))
            result["wall_s"] = round(time.perf_counter() - started, 1)
            report["policies"][policy] = result
            print(policy, json.dumps(result), flush=True)
        finally:
            stop_server(process)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
