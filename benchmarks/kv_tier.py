"""The second KV tier (issue 53), offline: what it buys when the KV pool is scarce, and that a
corrupted entry is never served.

One process runs the embedded SmolLM2-135M-Instruct with config/cpu.yaml's engine settings (what
`make serve` runs), except the KV pool's size (num_kv_blocks) and the tier: off, or kv_tier disk
in a fresh temporary directory. A TTFT is measured offline, one request at a time: from
add_request to the end of the step that returns its first token. Parts:

  working-set  multi-turn conversations, the users taking turns; every turn sends the history
               (questions and answers so far) and a new question, max_tokens 16, greedy. Their
               distinct cached blocks are --pool-ratio (4) times the pool. Tier off against
               disk, fresh engines, interleaved rounds. Goals: prefix-cache hit rate
               (prefix_cache_hits / prefix_cache_queries) with the tier >= 2x without; TTFT p50
               <= 0.5x.
  tier-prefix  a 2,000-token prefix computed once, then pushed out of the pool by other prompts
               (so it is only in the tier), then that prefix and a short suffix: TTFT against
               tier off, which computes it. Goal <= 0.3x.
  restart      the conversations on the tier, close() (it writes the pool's blocks to the tier),
               a new engine on the same directory, the same conversations for 32 more requests.
               Goal: their hit rate >= 90% of the last 32 before.
  drills       benchmarks/kv_tier_drills.py: entries corrupted on disk are detected and never
               served; a tier hit's greedy tokens equal a miss's in exact mode.

Rounds alternate which config goes first; figures are medians over rounds. Prints Markdown
tables and writes the JSON to --out. With the defaults 4 to 6 minutes on 2 cores (EPYC Zen 4),
more while other jobs share them (--num-threads 1 then keeps OpenMP from stalling):

    python benchmarks/kv_tier.py [--parts working-set,tier-prefix,restart,drills] \\
        [--rounds 3] [--prefix-rounds 5] [--out benchmarks/results/kv_tier.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import kv_tier_drills
from benchmarks.kv_tier_engine import (
    Chats,
    Served,
    build_engine,
    distinct_blocks,
    hit_rate,
    push_out,
    random_prompt,
    running_engine,
    serve,
    served_config,
)
from benchmarks.kv_tier_report import (
    TIERS,
    false_alarms,
    format_restart,
    format_tier_prefix,
    format_working_set,
)
from benchmarks.run_summary import cpu_line, percentile
from benchmarks.workloads import Conversation, long_conversations

PARTS = ("working-set", "tier-prefix", "restart", "drills")
_COUNTERS = (
    "num_evictions",
    "num_tier_stored_blocks",
    "num_tier_loaded_blocks",
    "num_tier_checksum_failures",
    "num_tier_refused_entries",
    "num_tier_missing_entries",
    "num_tier_dropped_entries",
    "num_tier_restored_at_start",
    "num_tier_ignored_at_start",
    "num_tier_spills_lost",
    "num_restore_audits",
    "num_restore_audit_corruptions",
    "kv_tier_entries",
    "kv_tier_bytes",
)


def round_order(round_index: int) -> tuple[str, ...]:
    return TIERS if round_index % 2 == 0 else TIERS[::-1]


def counters(engine) -> dict[str, int]:
    stats = engine.stats()
    return {name: getattr(stats, name) for name in _COUNTERS}


def request_record(served: Served) -> dict:
    record = asdict(served)
    record.pop("output_ids")
    return record


# ---------------------------------------------------------------- working set


def size_pool(tokenizer, conversations: list[Conversation], ratio: float) -> dict:
    """The pool for a working set `ratio` times its size, from the conversations' prompts with
    answers of max_tokens placeholder tokens; at least the largest request and 4 blocks."""
    chats = Chats(tokenizer, conversations)
    placeholder = tokenizer.encode(" ok", add_special_tokens=False)
    for turn in range(len(conversations[0].user_turns)):
        for index, conversation in enumerate(conversations):
            answer = placeholder * conversation.max_tokens[turn]
            chats.answer(index, turn, chats.prompt(index, turn), answer)
    block_size = served_config().block_size
    num_blocks = distinct_blocks(chats.sequences, block_size)
    largest = max(math.ceil(len(tokens) / block_size) for tokens in chats.sequences)
    pool = max(round(num_blocks / ratio), largest + 4)
    return {
        "num_kv_blocks": pool,
        "block_size": block_size,
        "estimated_working_set_blocks": num_blocks,
        "largest": largest,
    }


def conversation_run(tier: str, num_kv_blocks: int, tokenizer, conversations) -> dict:
    """Every turn of the conversations on a fresh engine."""
    chats = Chats(tokenizer, conversations)
    started = time.perf_counter()
    with running_engine(tier, num_kv_blocks) as engine:
        served = chats.run(engine, range(len(conversations[0].user_turns)))
        figures = counters(engine)
    later = served[len(conversations) :]  # every turn but the first of each conversation
    run = {
        "tier": tier,
        "hit_rate": hit_rate(served),
        "ttft_p50_s": percentile([s.ttft_s for s in served], 50),
        "later_turns_ttft_p50_s": percentile([s.ttft_s for s in later], 50),
        "later_turns_tier_load_p50_s": percentile([s.tier_load_s for s in later], 50),
        "later_turns_mostly_computed": num_mostly_computed(later),
        "num_prompt_tokens": sum(s.num_prompt_tokens for s in served),
        "working_set_blocks": distinct_blocks(chats.sequences, served_config().block_size),
        "wall_s": time.perf_counter() - started,
        "counters": figures,
        "requests": [request_record(s) for s in served],
    }
    print(
        f"  {tier}: hit rate {run['hit_rate']:.3f}, TTFT p50 {1000 * run['ttft_p50_s']:.0f} ms,"
        f" {run['wall_s']:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return run


def working_set(args, tokenizer) -> dict:
    conversations = long_conversations(
        args.conversations, args.turns, args.max_tokens, args.seed, args.context_words
    )
    sizing = size_pool(tokenizer, conversations, args.pool_ratio)
    pool = sizing["num_kv_blocks"]
    print(f"working-set: pool {pool} blocks, {sizing}", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {tier: [] for tier in TIERS}
    for round_index in range(args.rounds):
        print(f"working-set round {round_index}", file=sys.stderr, flush=True)
        for tier in round_order(round_index):
            runs[tier].append(conversation_run(tier, pool, tokenizer, conversations))
    medians = {
        tier: {
            key: statistics.median(run[key] for run in runs[tier])
            for key in ("hit_rate", "ttft_p50_s", "later_turns_ttft_p50_s", "working_set_blocks")
        }
        for tier in TIERS
    }
    return {"sizing": sizing, "runs": runs, "medians": medians}


# ---------------------------------------------------------------- a prefix in the tier


def tier_prefix(args) -> dict:
    """Per round a fresh prefix: computed on the disk engine, pushed into its tier, then served
    with a suffix (and once more from the pool); the off engine serves it computing it."""
    block_size = served_config().block_size
    prompt_tokens = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    pool = math.ceil(prompt_tokens / block_size) + 8  # one such request fits, with room
    rng = random.Random(args.seed)
    rows: dict[str, list[Served]] = {"off": [], "disk": [], "pool": []}
    with running_engine("off", pool) as off, running_engine("disk", pool) as disk:
        for round_index in range(args.prefix_rounds):
            prefix = random_prompt(rng, args.prefix_tokens)
            first, measured, again = (random_prompt(rng, args.suffix_tokens) for _ in range(3))
            for tier in round_order(round_index):
                if tier == "off":
                    rows["off"].append(serve(off, prefix + measured, args.max_tokens))
                    continue
                serve(disk, prefix + first, max_tokens=0)  # computed once
                push_out(disk, (pool + 1) * block_size, pool * block_size // 3, rng)
                rows["disk"].append(serve(disk, prefix + measured, args.max_tokens))
                rows["pool"].append(serve(disk, prefix + again, args.max_tokens))
            print(
                f"tier-prefix round {round_index}: "
                + ", ".join(f"{k} {1000 * v[-1].ttft_s:.0f} ms" for k, v in rows.items()),
                file=sys.stderr,
                flush=True,
            )
        figures = {"off": counters(off), "disk": counters(disk)}
    medians = {key: statistics.median(s.ttft_s for s in served) for key, served in rows.items()}
    return {
        "num_kv_blocks": pool,
        "medians_s": medians,
        "requests": {key: [request_record(s) for s in served] for key, served in rows.items()},
        "counters": figures,
    }


# ---------------------------------------------------------------- restart


def restart(args, tokenizer, num_kv_blocks: int) -> dict:
    """args.turns turns on the tier, a graceful close, a new engine on the same directory, and
    the next args.restart_requests requests of the same conversations."""
    turns_after = math.ceil(args.restart_requests / args.conversations)
    conversations = long_conversations(
        args.conversations, args.turns + turns_after, args.max_tokens, args.seed, args.context_words
    )
    # The later turns are longer: the pool holds the largest request whatever the ratio.
    largest = size_pool(tokenizer, conversations, args.pool_ratio)["largest"]
    num_kv_blocks = max(num_kv_blocks, largest + 4)
    chats = Chats(tokenizer, conversations)
    with tempfile.TemporaryDirectory(prefix="kvshare-tier-") as tier_dir:
        engine = build_engine("disk", num_kv_blocks, tier_dir)
        before = chats.run(engine, range(args.turns))
        figures_before = counters(engine)
        started = time.perf_counter()
        engine.close()
        close_s = time.perf_counter() - started
        del engine
        started = time.perf_counter()
        engine = build_engine("disk", num_kv_blocks, tier_dir)
        start_s = time.perf_counter() - started
        figures_at_start = counters(engine)
        try:
            after = chats.run(engine, range(args.turns, args.turns + turns_after))
            figures_after = counters(engine)
        finally:
            engine.close()
    last, first = before[-args.restart_requests :], after[: args.restart_requests]
    return {
        "num_kv_blocks": num_kv_blocks,
        "before": _phase(last),
        "after": _phase(first),
        "close_s": close_s,
        "start_s": start_s,
        "counters": {
            "before": figures_before,
            "at_start": figures_at_start,
            "after": figures_after,
        },
        "requests": {
            "before": [request_record(s) for s in before],
            "after": [request_record(s) for s in after],
        },
    }


def _phase(served: list[Served]) -> dict:
    return {
        "num_requests": len(served),
        "hit_rate": hit_rate(served),
        "ttft_p50_s": percentile([s.ttft_s for s in served], 50),
        "num_tier_hit_tokens": sum(s.num_tier_hit_tokens for s in served),
        "num_mostly_computed": num_mostly_computed(served),
    }


def num_mostly_computed(served: list[Served]) -> int:
    """Requests that took less than half their prompt from the caches."""
    return sum(2 * s.num_hit_tokens < s.num_prompt_tokens for s in served)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="working-set rounds")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--context-words", type=int, default=120, help="each opening's context")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="working set / pool")
    parser.add_argument("--prefix-rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--restart-requests", type=int, default=32)
    parser.add_argument("--drill-prompt-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: cpu.yaml's)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tier.json"))
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from engine.runtime.loader import resolve_model_dir

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(served_config())))
    started = time.perf_counter()
    report: dict = {"cpu": cpu_line(), "args": {k: str(v) for k, v in vars(args).items()}}
    tables = []
    sizing = size_pool(
        tokenizer,
        long_conversations(
            args.conversations, args.turns, args.max_tokens, args.seed, args.context_words
        ),
        args.pool_ratio,
    )
    parts = {
        "working-set": (lambda: working_set(args, tokenizer), format_working_set),
        "tier-prefix": (lambda: tier_prefix(args), format_tier_prefix),
        "restart": (lambda: restart(args, tokenizer, sizing["num_kv_blocks"]), format_restart),
        "drills": (
            lambda: kv_tier_drills.run_drills(args),
            lambda result, _args: kv_tier_drills.format_drills(result),
        ),
    }
    for name in args.parts:
        part_started = time.perf_counter()
        measure, format_part = parts[name]
        report[name] = measure()
        report[name]["wall_s"] = time.perf_counter() - part_started
        print(f"{name}: {report[name]['wall_s']:.0f} s", file=sys.stderr, flush=True)
        tables.append(format_part(report[name], args))
    report["false_alarms"] = false_alarms(report)
    report["wall_s"] = time.perf_counter() - started
    tables.append(
        f"Clean tier engines (every part but the drills): {report['false_alarms']}.\n\n"
        f"{report['cpu']}; {report['wall_s']:.0f} s."
    )
    print("\n\n".join(tables))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
