"""What the replica drill (benchmarks/replicas.py) reads and reports: the prefix-cache and
eviction counters of a replica's /metrics, the KV history its conversations leave, runs pooled
into one row per (target, workload), the goal and the Markdown table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from benchmarks.run_summary import percentile
from benchmarks.serving import RequestResult

POLICIES = ("cache_aware", "round_robin")  # the gateway's, one run each
TARGETS = (*POLICIES, "single")
WORKLOADS = ("multi-turn", "many-system-prompts")
HITS = "kvshare_prefix_cache_hits_total"
QUERIES = "kvshare_prefix_cache_queries_total"
EVICTIONS = "kvshare_kv_evictions_total"
CACHE_CONFIG = "kvshare_cache_config_info"


@dataclass
class Run:
    """One workload through one target in one round, with one KV pool size per replica."""

    pool: int | None
    round: int
    target: str
    workload: str
    seed: int
    hits: float
    queries: float
    per_replica_queries: list[float]
    evicted_blocks: int  # blocks the replicas' prefix caches evicted during the run
    history_blocks: int  # full blocks of the conversations' histories at the end of the run
    summary: dict
    ttft_s: list[float] = field(default_factory=list)


def samples(text: str) -> list[Sample]:
    """Every sample of a /metrics text (prometheus_client's parser of the text format)."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def counters(text: str) -> tuple[float, float, float]:
    """(hits, queries, evicted blocks): a /metrics text's prefix-cache and eviction counters,
    each summed over its label sets."""
    totals = {HITS: 0.0, QUERIES: 0.0, EVICTIONS: 0.0}
    for sample in samples(text):
        if sample.name in totals:
            totals[sample.name] += sample.value
    return totals[HITS], totals[QUERIES], totals[EVICTIONS]


def block_size_in(text: str) -> int:
    """Tokens per KV block, from the kvshare_cache_config_info gauge of a /metrics text."""
    for sample in samples(text):
        if sample.name == CACHE_CONFIG:
            return int(sample.labels["block_size"])
    raise RuntimeError(f"/metrics has no {CACHE_CONFIG} sample")


def history_blocks(results: list[RequestResult], block_size: int) -> int:
    """Full KV blocks of each conversation's history after its last completed turn, summed over
    the conversations: what the prefix cache keeps of it (the prompt and the answer but its
    last token, whose KV is never computed). A prefix that conversations share, such as the
    chat template's default system prompt, counts once in each."""
    last: dict[int, RequestResult] = {}
    for r in results:
        if r.ok and (r.conversation_id not in last or r.turn > last[r.conversation_id].turn):
            last[r.conversation_id] = r
    return sum((r.prompt_tokens + r.output_tokens - 1) // block_size for r in last.values())


def aggregate(runs: list[Run]) -> list[dict]:
    """One row per (target, workload), pooled over rounds."""
    rows = []
    for workload in WORKLOADS:
        for target in TARGETS:
            mine = [r for r in runs if r.target == target and r.workload == workload]
            if not mine:
                continue
            hits, queries = sum(r.hits for r in mine), sum(r.queries for r in mine)
            ttft = [t for r in mine for t in r.ttft_s]
            output_tokens = sum(r.summary["output_tokens"] for r in mine)
            duration_s = sum(r.summary["duration_s"] for r in mine)
            rows.append(
                {
                    "workload": workload,
                    "target": target,
                    "rounds": len(mine),
                    "completed": sum(r.summary["completed"] for r in mine),
                    "planned": sum(r.summary["num_requests"] for r in mine),
                    "hit_rate": hits / queries if queries else 0.0,
                    "ttft_p50_s": percentile(ttft, 50) if ttft else None,
                    "ttft_p99_s": percentile(ttft, 99) if ttft else None,
                    "output_tok_s": output_tokens / duration_s if duration_s else 0.0,
                    "history_blocks": max(r.history_blocks for r in mine),
                    "evicted_blocks": sum(r.evicted_blocks for r in mine),
                    "replica_query_split": [
                        sum(r.per_replica_queries[i] for r in mine)
                        for i in range(len(mine[0].per_replica_queries))
                    ],
                }
            )
    return rows


def goal(rows: list[dict]) -> dict:
    """Multi-turn: cache_aware >= 0.9x single's hit rate and >= 1.5x round_robin's."""
    rate = {r["target"]: r["hit_rate"] for r in rows if r["workload"] == "multi-turn"}
    vs_single = rate["cache_aware"] / rate["single"] if rate.get("single") else None
    vs_rr = rate["cache_aware"] / rate["round_robin"] if rate.get("round_robin") else None
    return {
        "cache_aware_vs_single": vs_single,
        "cache_aware_vs_round_robin": vs_rr,
        "met": vs_single is not None and vs_rr is not None and vs_single >= 0.9 and vs_rr >= 1.5,
    }


def pool_label(pool: int | None) -> str:
    return "the config's KV pool" if pool is None else f"{pool} KV blocks per replica"


def format_table(rows: list[dict], check: dict, pool: int | None) -> str:
    single_pool = "the same" if pool is None else f"{2 * pool} blocks"
    history = max((r["history_blocks"] for r in rows if r["workload"] == "multi-turn"), default=0)
    lines = [
        f"{pool_label(pool)} (single: {single_pool}); the multi-turn conversations' "
        f"histories add up to {history} blocks",
        "",
        "| workload | target | done | prefix hit rate | evicted blocks | TTFT p50 (ms) "
        "| TTFT p99 (ms) | output tok/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p50 = f"{1000 * r['ttft_p50_s']:.0f}" if r["ttft_p50_s"] is not None else "-"
        p99 = f"{1000 * r['ttft_p99_s']:.0f}" if r["ttft_p99_s"] is not None else "-"
        lines.append(
            f"| {r['workload']} | {r['target']} | {r['completed']}/{r['planned']} | "
            f"{r['hit_rate']:.3f} | {r['evicted_blocks']} | {p50} | {p99} | "
            f"{r['output_tok_s']:.1f} |"
        )

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines.append("")
    lines.append(
        f"multi-turn hit rate, cache_aware vs single: {ratio(check['cache_aware_vs_single'])} "
        f"(goal >= 0.9x); vs round_robin: {ratio(check['cache_aware_vs_round_robin'])} "
        f"(goal >= 1.5x); goal {'met' if check['met'] else 'NOT met'}"
    )
    return "\n".join(lines)
