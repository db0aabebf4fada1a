"""The prefix cache under Gemma 3 270M: its hit rate against SmolLM2's, and a long prefix's TTFT.

    python benchmarks/gemma_cache.py [--mode both|hit-rate|ttft] [--rounds 2] \
        [--ttft-rounds 7] [--prefix-tokens 2000] [--quick] [--out benchmarks/results/gemma.json]

hit-rate: kvshare only, SmolLM2 and Gemma (peer_servers.MODELS) in one run, each as `make serve`
runs it (config/cpu.yaml, its quantization): shared-prefix and multi-turn through
benchmarks/serving.py at concurrency 1 and 8, with benchmarks/vs_llama_server.py's requests,
rounds and order (each server fresh, the order reversed every other round). The hit rate is
read from /metrics: prompt tokens found in the prefix cache over those looked up, per run,
the median over rounds. Goal: Gemma's within 2 points of SmolLM2's.

ttft: one Gemma server. Each round a new prefix of --prefix-tokens tokens (a nonce opens it,
so nothing of it is cached) goes as the system prompt with one question (the miss), then with
another (the hit: the same prefix, a new suffix); TTFT medians over rounds. Goal: the hit's at
most 0.2x the miss's.

Exit status 0 when every request completed (goals missed are reported), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import peer_servers, run_summary, servers, serving, workloads  # noqa: E402
from benchmarks.peer_servers import Peers  # noqa: E402
from benchmarks.vs_llama_server import (  # noqa: E402
    fmt,
    median,
    medians,
    percent,
    round_order,
    run_server_round,
    warm_up,
)

GEMMA = "gemma-3-270m"
WORKLOADS = ("shared-prefix", "multi-turn")
CONCURRENCIES = (1, 8)
HIT_RATE_GOAL_POINTS = 2.0  # Gemma's hit rate at most this many points from SmolLM2's
TTFT_GOAL = 0.2  # a hit's TTFT at most this fraction of a miss's
TTFT_MAX_TOKENS = 4  # only the first token's time counts


# ---------------------------------------------------------------- hit rate


def measure_hit_rates(args, mode: str) -> list[dict]:
    """Every model's kvshare server, one at a time, on both workloads; the runs as
    vs_llama_server.run_server_round records them (with the hit rate)."""
    variants = {
        name: [*model.serve_flags, "--quantization", mode]
        for name, model in peer_servers.MODELS.items()
    }
    plan = {"workloads": list(WORKLOADS), "concurrencies": list(CONCURRENCIES),
            "num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
            "max_tokens": args.max_tokens, "timeout_s": 1800.0}  # fmt: skip
    peers = Peers(kvshare_variants=variants)
    results = []
    for round_index in range(args.rounds):
        for name in round_order(list(variants), round_index):
            print(f"hit rate, round {round_index + 1}/{args.rounds}: {name}", flush=True)
            results += run_server_round(name, peers, plan, round_index)
    return results


def hit_rate_table(results: list[dict]) -> str:
    """Gemma's hit rate beside SmolLM2's per (workload, concurrency), against the goal."""
    table = medians(results)
    lines = ["| workload | c | smollm2 hit rate | gemma-3-270m hit rate | gemma - smollm2 "
             "(points) | goal |", "|---|---|---|---|---|---|"]  # fmt: skip
    for workload in WORKLOADS:
        for concurrency in CONCURRENCIES:
            ours = table.get((workload, concurrency, GEMMA), {}).get("hit_rate")
            theirs = table.get((workload, concurrency, "smollm2"), {}).get("hit_rate")
            points = None if ours is None or theirs is None else 100 * (ours - theirs)
            met = points is not None and abs(points) <= HIT_RATE_GOAL_POINTS
            verdict = "-" if points is None else ("met" if met else "missed")
            cells = [workload, str(concurrency), percent(theirs), percent(ours),
                     "-" if points is None else f"{points:+.1f}",
                     f"within {HIT_RATE_GOAL_POINTS:g}: {verdict}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- TTFT


def measure_ttft(args, mode: str) -> list[dict]:
    """A Gemma server; per round a fresh prefix, sent with a first suffix, then a second."""
    flags = [*peer_servers.MODELS[GEMMA].serve_flags, "--quantization", mode]
    with servers.running_kvshare(*flags) as root_url:
        warm_up(f"{root_url}/v1")
        prefixes = long_prefixes(root_url, args.prefix_tokens, args.ttft_rounds, args.seed)
        return asyncio.run(_ttft_rounds(f"{root_url}/v1", prefixes))


def long_prefixes(root_url: str, num_tokens: int, num_rounds: int, seed: int) -> list:
    """One conversation per round whose opening is about num_tokens tokens of the served
    model (sized with POST /tokenize) and whose next two turns are the two suffixes."""

    def build(num_words: int) -> list[workloads.Conversation]:
        return workloads.long_conversations(num_rounds, 3, TTFT_MAX_TOKENS, seed, num_words)

    sample = build(num_tokens)[0].user_turns[0]
    response = httpx.post(f"{root_url}/tokenize", json={"prompt": sample}, trust_env=False,
                          timeout=60.0)  # fmt: skip
    response.raise_for_status()
    return build(max(1, round(num_tokens * num_tokens / response.json()["count"])))


async def _ttft_rounds(base_url: str, conversations: list) -> list[dict]:
    """Miss, then hit, round after round (interleaved: the machine's drift hits both alike)."""
    records = []
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        model = await serving.discover_model(client, base_url)
        for index, conversation in enumerate(conversations):
            prefix, *suffixes = conversation.user_turns
            for kind, suffix in zip(("miss", "hit"), suffixes, strict=True):
                messages = [{"role": "system", "content": prefix},
                            {"role": "user", "content": suffix}]  # fmt: skip
                result = await _first_token(client, base_url, model, messages)
                records.append({"round": index, "kind": kind, "ok": result.ok,
                                "error": result.error, "ttft_s": result.ttft_s,
                                "prompt_tokens": result.prompt_tokens,
                                "cached_tokens": result.cached_tokens})  # fmt: skip
                cached = f"{result.cached_tokens}/{result.prompt_tokens} prompt tokens cached"
                print(f"  round {index + 1} {kind}: {_ms(result.ttft_s)} ms, {cached}", flush=True)
    return records


async def _first_token(
    client: httpx.AsyncClient, base_url: str, model: str, messages: list[dict]
) -> serving.RequestResult:
    config = serving.BenchmarkConfig(base_url=base_url, model=model, max_tokens=TTFT_MAX_TOKENS)
    body = serving.request_body(config, model, messages, TTFT_MAX_TOKENS)  # the client's body
    result = serving.RequestResult(conversation_id=0, turn=0)
    return await serving.stream_chat(client, f"{base_url}/chat/completions", body, result)


def ttft_table(records: list[dict]) -> str:
    """Median TTFT, prompt and cached tokens of misses and hits, against the goal."""
    lines = ["| request | rounds | prompt tokens | cached tokens | TTFT median (ms) |",
             "|---|---|---|---|---|"]  # fmt: skip
    ttft = {}
    for kind in ("miss", "hit"):
        done = [r for r in records if r["kind"] == kind and r["ok"]]
        ttft[kind] = median(r["ttft_s"] for r in done)
        cells = [kind, str(len(done)), fmt(median(r["prompt_tokens"] for r in done), ".0f"),
                 fmt(median(r["cached_tokens"] for r in done), ".0f"), _ms(ttft[kind])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    ratio = ttft["hit"] / ttft["miss"] if ttft["hit"] and ttft["miss"] else None
    is_met = ratio is not None and ratio <= TTFT_GOAL
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    lines.append(f"\nhit / miss: {shown} (goal <= {TTFT_GOAL}x: {'met' if is_met else 'missed'})")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else 1000 * seconds, ".0f")


# ---------------------------------------------------------------- command line


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("both", "hit-rate", "ttft"), default="both")
    parser.add_argument("--rounds", type=int, default=2, help="hit-rate rounds")
    parser.add_argument("--num-requests", type=int, default=32, help="requests at concurrency 8")
    parser.add_argument("--num-requests-c1", type=int, default=16, help="at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-rounds", type=int, default=7, help="misses and hits, each")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument(
        "--quantization",
        default=None,
        help="kvshare's mode (default: config/cpu.yaml's engine.quantization)",
    )
    parser.add_argument("--quick", action="store_true", help="1 round each, 4 requests, 16 tokens")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.ttft_rounds = 1, 1
        args.num_requests, args.num_requests_c1, args.max_tokens = 4, 4, 16
    if min(args.rounds, args.ttft_rounds, args.num_requests, args.num_requests_c1) < 1:
        parser.error("rounds and request counts must be at least 1")
    if args.prefix_tokens < 16:
        parser.error("--prefix-tokens must be at least one block (16)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    mode = args.quantization or peer_servers.serve_config_quantization()
    print(f"{run_summary.cpu_line()}; kvshare --quantization {mode}", flush=True)
    report: dict = {"machine": run_summary.cpu_line(), "quantization": mode}
    tables, is_complete = [], True
    if args.mode in ("both", "hit-rate"):
        report["hit_rate_runs"] = measure_hit_rates(args, mode)
        table = hit_rate_table(report["hit_rate_runs"])
        tables.append(f"\nprefix-cache hit rate, medians of {args.rounds} rounds\n{table}")
        is_complete &= all(r["summary"]["completed"] == r["summary"]["num_requests"]
                           for r in report["hit_rate_runs"])  # fmt: skip
    if args.mode in ("both", "ttft"):
        report["ttft_requests"] = measure_ttft(args, mode)
        table = ttft_table(report["ttft_requests"])
        tables.append(f"\n{GEMMA}, a {args.prefix_tokens}-token shared prefix\n{table}")
        is_complete &= all(r["ok"] for r in report["ttft_requests"])
    print("\n".join(tables))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if is_complete else 1


if __name__ == "__main__":
    sys.exit(main())
