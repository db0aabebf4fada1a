"""benchmarks/kv_tier.py's tables: each part's figures against the goals of issue 53, and the
verification failures of the clean tier engines (false alarms)."""

from __future__ import annotations

import math

TIERS = ("off", "disk")
HIT_RATE_GOAL = 2.0  # working-set: hit rate with the tier / without, at least
TTFT_GOAL = 0.5  # working-set: TTFT p50 with the tier / without, at most
PREFIX_TTFT_GOAL = 0.3  # tier-prefix: TTFT from the tier / recomputed, at most
RESTART_GOAL = 0.9  # restart: hit rate after / before, at least


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}"


def _goal(ratio: float, goal: float, at_most: bool) -> str:
    met = ratio <= goal if at_most else ratio >= goal
    return f"{ratio:.2f}x (goal {'<=' if at_most else '>='} {goal}x: {'met' if met else 'missed'})"


def format_working_set(result: dict, args) -> str:
    sizing, medians, runs = result["sizing"], result["medians"], result["runs"]
    pool = sizing["num_kv_blocks"]
    ws = medians["disk"]["working_set_blocks"]
    off, disk = medians["off"], medians["disk"]
    lines = [
        f"### Working set {ws / pool:.1f}x the pool: {args.conversations} conversations x "
        f"{args.turns} turns, max_tokens {args.max_tokens}, one request at a time",
        "",
        f"Pool {pool} blocks ({pool * sizing['block_size']} tokens); working set {ws} blocks "
        "(the distinct full blocks of every request's prompt and output; sized from an estimate of "
        f"{sizing['estimated_working_set_blocks']}), {ws / pool:.2f}x the pool. "
        f"{args.rounds} rounds, fresh engines.",
        "",
        "| tier | hit rate | TTFT p50 ms | TTFT p50 ms, turns 2+ | per round: hit rate / "
        "TTFT p50 ms / turns 2+ mostly computed / restore audits |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for tier in TIERS:
        rounds = ", ".join(
            f"{r['hit_rate']:.3f} / {_ms(r['ttft_p50_s'])} / {r['later_turns_mostly_computed']}"
            f" / {r['counters']['num_restore_audits']}"
            for r in runs[tier]
        )
        m = medians[tier]
        lines.append(
            f"| {tier} | {m['hit_rate']:.3f} | {_ms(m['ttft_p50_s'])} | "
            f"{_ms(m['later_turns_ttft_p50_s'])} | {rounds} |"
        )
    hit = disk["hit_rate"] / off["hit_rate"] if off["hit_rate"] else math.inf
    lines.append(
        f"| disk / off | {_goal(hit, HIT_RATE_GOAL, False)} | "
        f"{_goal(disk['ttft_p50_s'] / off['ttft_p50_s'], TTFT_GOAL, True)} | "
        f"{disk['later_turns_ttft_p50_s'] / off['later_turns_ttft_p50_s']:.2f}x | - |"
    )
    return "\n".join(lines)


def format_tier_prefix(result: dict, args) -> str:
    medians, requests = result["medians_s"], result["requests"]
    tier_tokens = [r["num_tier_hit_tokens"] for r in requests["disk"]]
    pool_tokens = [r["num_hit_tokens"] - r["num_tier_hit_tokens"] for r in requests["disk"]]
    loads = [r["tier_load_s"] for r in requests["disk"]]
    labels = {
        "off": "tier off (computed)",
        "disk": "from the tier",
        "pool": "from the pool (context)",
    }
    lines = [
        f"### A {args.prefix_tokens}-token prefix in the tier, + {args.suffix_tokens} tokens",
        "",
        f"Pool {result['num_kv_blocks']} blocks; {args.prefix_rounds} rounds, a fresh prefix "
        f"each. From the tier, per round: {tier_tokens} tokens (pool: {pool_tokens}), tier "
        f"loads {', '.join(_ms(s) for s in loads)} ms.",
        "",
        "| request | TTFT median ms | per round ms |",
        "| --- | ---: | --- |",
    ]
    for key, label in labels.items():
        rounds = ", ".join(_ms(r["ttft_s"]) for r in requests[key])
        lines.append(f"| {label} | {_ms(medians[key])} | {rounds} |")
    ratio = medians["disk"] / medians["off"]
    lines.append(f"| tier / off | {_goal(ratio, PREFIX_TTFT_GOAL, True)} | - |")
    return "\n".join(lines)


def format_restart(result: dict, args) -> str:
    before, after = result["before"], result["after"]
    at_start = result["counters"]["at_start"]
    num_saved = at_start["kv_tier_entries"] - result["counters"]["before"]["kv_tier_entries"]
    lines = [
        f"### Restart: {args.turns} turns, close(), a new engine, {args.restart_requests} more",
        "",
        f"Pool {result['num_kv_blocks']} blocks. close() {1000 * result['close_s']:.1f} ms "
        f"({num_saved} blocks written); the new "
        f"engine built in {result['start_s']:.1f} s with {at_start['num_tier_restored_at_start']}"
        f" entries restored at start ({at_start['kv_tier_bytes'] / 2**20:.0f} MiB), "
        f"{at_start['num_tier_ignored_at_start']} ignored.",
        "",
        "| requests | hit rate | TTFT p50 ms | tokens from the tier | mostly computed |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| last {before['num_requests']} before close | {before['hit_rate']:.3f} | "
        f"{_ms(before['ttft_p50_s'])} | {before['num_tier_hit_tokens']} | "
        f"{before['num_mostly_computed']} |",
        f"| first {after['num_requests']} after restart | {after['hit_rate']:.3f} | "
        f"{_ms(after['ttft_p50_s'])} | {after['num_tier_hit_tokens']} | "
        f"{after['num_mostly_computed']} |",
        f"| after / before | {_goal(after['hit_rate'] / before['hit_rate'], RESTART_GOAL, False)}"
        " | - | - | - |",
    ]
    return "\n".join(lines)


def false_alarms(report: dict) -> dict[str, int]:
    """Verification failures of the clean tier engines (every part but the drills)."""
    found = []
    if "working-set" in report:
        found += [run["counters"] for run in report["working-set"]["runs"]["disk"]]
    if "tier-prefix" in report:
        found.append(report["tier-prefix"]["counters"]["disk"])
    if "restart" in report:
        found += list(report["restart"]["counters"].values())
    names = (
        "num_tier_checksum_failures",
        "num_tier_refused_entries",
        "num_tier_ignored_at_start",
        "num_restore_audit_corruptions",
        "num_tier_loaded_blocks",
        "num_restore_audits",
    )
    return {name: sum(figures[name] for figures in found) for name in names}
