"""Structured outputs benchmark: json_schema vs unconstrained throughput, and grammar compile time.

    python benchmarks/structured.py --rounds 2 --concurrency 8 --num-requests 16 \
        --out benchmarks/results/structured.json

Starts a `kvshare serve` (config/cpu.yaml plus --server-args) unless --url names one. The
requests are the schemas of benchmarks/structured_schemas.py (those of
tests/integration/test_structured_http.py), each with its prompt, temperature 1 and a fixed
seed, streamed at a fixed concurrency.

- A warm-up pass sends the json_schema requests once: it compiles (and caches) every grammar and
  records each request's output length from `usage`. Seeded outputs are batch invariant, so the
  timed constrained passes produce exactly these lengths again.
- Each round times the json_schema pass and the unconstrained pass (the same prompts, seeds and
  sampling without `response_format`, with `max_tokens` set to that request's constrained length
  and `ignore_eos`), so both pass types generate the same number of tokens from the same
  prompts. The order alternates between rounds; the table gives the medians.
- Compile time: for every schema, a variant never seen before (a fresh `$comment`, which is part
  of the grammar cache key) is sent twice with max_tokens 1: cold (a cache miss: the
  `kvshare_grammar_compile_seconds` histogram's sum grows by the compile) and then cached
  (a hit: the histogram does not move); both requests' end-to-end latencies are recorded too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
import uuid
from contextlib import nullcontext
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import running_kvshare, scrape
from benchmarks.serving import RequestResult, discover_model, stream_chat
from benchmarks.structured_schemas import SCHEMAS

GOAL = 0.9  # constrained output tok/s at least this fraction of unconstrained
COMPILE_SUM = "kvshare_grammar_compile_seconds_sum"
COMPILE_COUNT = "kvshare_grammar_compile_seconds_count"
HITS = "kvshare_grammar_cache_hits_total"


def _body(model: str, index: int, seed: int, max_tokens: int, constrained: bool) -> dict:
    name, ask, schema = SCHEMAS[index % len(SCHEMAS)]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": ask}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    else:
        body["ignore_eos"] = True  # exactly max_tokens tokens: the constrained length
    return body


async def _pass(
    client: httpx.AsyncClient, url: str, bodies: list[dict], concurrency: int
) -> tuple[list[RequestResult], float]:
    limiter = asyncio.Semaphore(concurrency)

    async def one(index: int, body: dict) -> RequestResult:
        async with limiter:
            return await stream_chat(client, url, body, RequestResult(index, 0))

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return list(results), time.perf_counter() - start


def _check(results: list[RequestResult], label: str) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed, first: {failed[0].error}")


async def _compile_times(client: httpx.AsyncClient, base_url: str, model: str) -> list[dict]:
    url = f"{base_url}/v1/chat/completions"
    rows = []
    for index, (name, _, schema) in enumerate(SCHEMAS):
        fresh = {**schema, "$comment": f"bench {uuid.uuid4().hex}"}
        body = _body(model, index, 0, 1, constrained=True)
        body["response_format"]["json_schema"]["schema"] = fresh
        row = {"schema": name}
        for label in ("cold", "cached"):
            before = scrape(base_url)
            start = time.perf_counter()
            result = await stream_chat(client, url, body, RequestResult(index, 0))
            row[f"{label}_request_s"] = time.perf_counter() - start
            after = scrape(base_url)
            if not result.ok:
                raise RuntimeError(f"compile {name} {label}: {result.error}")
            row[f"{label}_compiles"] = after[COMPILE_COUNT] - before[COMPILE_COUNT]
            row[f"{label}_compile_s"] = after[COMPILE_SUM] - before[COMPILE_SUM]
            row[f"{label}_hits"] = after.get(HITS, 0.0) - before.get(HITS, 0.0)
        rows.append(row)
    return rows


async def run(args: argparse.Namespace, base_url: str) -> dict:
    url = f"{base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False) as c:
        model = await discover_model(c, f"{base_url}/v1")
        compile_rows = await _compile_times(c, base_url, model)
        indices = range(args.num_requests)
        seeds = [1000 + i for i in indices]
        constrained = [
            _body(model, i, s, args.max_tokens, True) for i, s in zip(indices, seeds, strict=True)
        ]
        warm, _ = await _pass(c, url, constrained, args.concurrency)
        _check(warm, "warm-up")
        lengths = [r.output_tokens for r in warm]
        free = [
            _body(model, i, s, n, False) for i, s, n in zip(indices, seeds, lengths, strict=True)
        ]
        rounds = []
        for number in range(args.rounds):
            order = ("json_schema", "unconstrained")
            order = order if number % 2 == 0 else order[::-1]
            row = {}
            for kind in order:
                bodies = constrained if kind == "json_schema" else free
                results, seconds = await _pass(c, url, bodies, args.concurrency)
                _check(results, f"round {number} {kind}")
                tokens = sum(r.output_tokens for r in results)
                row[kind] = {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}
                if kind == "json_schema" and [r.output_tokens for r in results] != lengths:
                    row["lengths_differ"] = True  # would break like-with-like; reported
            rounds.append(row)
            print(f"round {number}: {json.dumps(row)}", flush=True)
    return {"lengths": lengths, "rounds": rounds, "compile": compile_rows}


def _median(values) -> float:
    return statistics.median(list(values))


def format_markdown(report: dict, concurrency: int) -> str:
    rounds = report["rounds"]
    on = _median(r["json_schema"]["tok_s"] for r in rounds)
    off = _median(r["unconstrained"]["tok_s"] for r in rounds)
    ratio = on / off
    paired = [r["json_schema"]["tok_s"] / r["unconstrained"]["tok_s"] for r in rounds]
    met = "yes" if ratio >= GOAL else "no"
    lines = [
        "| metric | json_schema | unconstrained | ratio | goal | met |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| output tok/s at concurrency {concurrency} (median of {len(rounds)}) | {on:.1f} | "
        f"{off:.1f} | {ratio:.2f}x | >= {GOAL}x | {met} |",
        "",
        "per round (tok/s json_schema / unconstrained): "
        + ", ".join(
            f"{r['json_schema']['tok_s']:.1f} / {r['unconstrained']['tok_s']:.1f}" for r in rounds
        )
        + f"; median of the per-round ratios {_median(paired):.2f}x; "
        f"{sum(report['lengths'])} output tokens per pass",
        "",
        "| schema | cold compile (ms) | cold request (ms) | cached compile (ms) "
        "| cached request (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report["compile"]:
        cached = (
            "0 (hit)" if row["cached_compiles"] == 0 else f"{1000 * row['cached_compile_s']:.1f}"
        )
        cold = f"{1000 * row['cold_compile_s']:.1f}"
        if row["cold_compiles"] != 1:
            cold += f" ({row['cold_compiles']:.0f} compiles)"
        lines.append(
            f"| {row['schema']} | {cold} | {1000 * row['cold_request_s']:.0f} | {cached} | "
            f"{1000 * row['cached_request_s']:.0f} |"
        )
    compile_rows = report["compile"]
    lines.append(
        f"| median | {1000 * _median(r['cold_compile_s'] for r in compile_rows):.1f} | "
        f"{1000 * _median(r['cold_request_s'] for r in compile_rows):.0f} | "
        f"{1000 * _median(r['cached_compile_s'] for r in compile_rows):.1f} | "
        f"{1000 * _median(r['cached_request_s'] for r in compile_rows):.0f} |"
    )
    if any(r.get("lengths_differ") for r in rounds):
        lines.append("\nwarning: a timed json_schema pass produced other lengths than the warm-up")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (http://host:port)")
    parser.add_argument("--server-args", default="", help="extra `kvshare serve` flags")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=16, help="requests per pass")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if min(args.rounds, args.concurrency, args.num_requests, args.max_tokens) < 1:
        parser.error("--rounds, --concurrency, --num-requests and --max-tokens must be positive")
    started = time.perf_counter()
    server = (
        nullcontext(args.url.rstrip("/"))
        if args.url
        else running_kvshare(*shlex.split(args.server_args))
    )
    with server as base_url:
        report = asyncio.run(run(args, base_url))
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["wall_s"] = time.perf_counter() - started
    print(format_markdown(report, args.concurrency))
    print(f"\nwhole run: {report['wall_s']:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
