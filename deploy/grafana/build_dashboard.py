"""Generates deploy/grafana/kvshare.json, the kvshare Grafana dashboard.

    python deploy/grafana/build_dashboard.py          # rewrite kvshare.json
    python deploy/grafana/build_dashboard.py --check  # exit 1 if kvshare.json is out of date

Every query filters on the `$instance` variable and uses Grafana's `$__rate_interval`, so the
dashboard works for one container and for a Kubernetes fleet. tests/deploy/promql.py extracts
these expressions (with the variables substituted) for the live-Prometheus integration test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUTPUT = Path(__file__).with_name("kvshare.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'  # every selector carries it
RATE = "[$__rate_interval]"


def rate(metric: str, labels: str = "") -> str:
    selector = f"{SEL},{labels}" if labels else SEL
    return f"rate({metric}{{{selector}}}{RATE})"


def sum_rate(metric: str, labels: str = "") -> str:
    return f"sum({rate(metric, labels)})"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket')}))"


def latency_targets(histogram: str) -> list[tuple[str, str]]:
    return [(quantile(0.5, histogram), "p50"), (quantile(0.99, histogram), "p99")]


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    description: str = "",
    kind: str = "timeseries",
    stacked: bool = False,
    thresholds: list[tuple[float, str]] | None = None,
    text_mode: str = "auto",
) -> dict:
    """One panel; `targets` are (PromQL, legend) pairs. Its gridPos is set by `layout`.
    `text_mode` is a stat panel's: "name" shows only the legend (for info metrics)."""
    steps = [{"color": "green", "value": None}]
    steps += [{"color": color, "value": value} for value, color in thresholds or []]
    custom = {"stacking": {"mode": "normal" if stacked else "none", "group": "A"}}
    if stacked:
        custom["fillOpacity"] = 60
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
                **({"custom": custom} if kind == "timeseries" else {}),
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background",
              "textMode": text_mode},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
             "datasource": DATASOURCE}
            for i, (expr, legend) in enumerate(targets)
        ],
    }  # fmt: skip


def cache_panels() -> list[dict]:
    hits = sum_rate("kvshare_prefix_cache_hits_total")
    queries = sum_rate("kvshare_prefix_cache_queries_total")
    audits = sum_rate("kvshare_cache_audits_total")
    corruption = sum_rate("kvshare_cache_audit_mismatches_total", 'kind="corruption"')
    drift = sum_rate("kvshare_cache_audit_mismatches_total", 'kind="drift"')
    misses = f"sum by (reason) ({rate('kvshare_prefix_cache_miss_tokens_total')})"
    segments = f"sum by (segment) ({rate('kvshare_prefix_cache_divergence_total')})"
    return [
        panel("Prefix-cache hit rate", [(f"{hits} / {queries}", "hit rate")], "percentunit",
              "Prompt tokens found in the cache / prompt tokens looked up."),
        panel("Pollution rate", [(f"{corruption} / {audits}", "corruption"),
                                 (f"{drift} / {audits}", "drift")], "percentunit",
              "Audited reuses whose KV differed from a recomputation. Corruption must stay 0."),
        panel("Audits per second", [(audits, "audits/s")], "ops"),
        panel("Audit max |diff| p99", [(quantile(0.99, "kvshare_cache_audit_max_abs_diff"), "p99")],
              description="Largest absolute KV difference seen by the audit (numeric drift)."),
        panel("Why prompt tokens miss", [(misses, "{{reason}}")], "short",
              "Prompt tokens per second not served from the prefix cache, by the reason of "
              "their request's miss (docs/cache-diagnostics.md). diverged growing while the "
              "hit rate falls: per-request content before static content.", stacked=True),
        panel("Where diagnosed prompts diverge", [(segments, "{{segment}}")], "short",
              "Requests with cache_diagnostics per second, by the segment of their first "
              "prompt token not served from the cache.", stacked=True),
        panel("Quarantined blocks (since start)",
              [(f'sum(kvshare_cache_quarantined_blocks_total{{{SEL}}})', "quarantined")],
              description="Blocks taken out of service after a failed audit."),
        panel("Leaked blocks", [(f'max(kvshare_kv_blocks_leaked{{{SEL}}})', "leaked")], kind="stat",
              thresholds=[(1, "red")],
              description="Blocks owned by nobody: an accounting bug. Must stay 0."),
    ]  # fmt: skip


def memory_panels() -> list[dict]:
    total = f"sum(kvshare_kv_blocks_total{{{SEL}}})"
    available = f'sum(kvshare_kv_blocks{{{SEL},state=~"free|cached"}})'
    free = f'sum(kvshare_kv_blocks{{{SEL},state="free"}})'
    return [
        panel("KV blocks by state", [(f"sum by (state) (kvshare_kv_blocks{{{SEL}}})", "{{state}}")],
              stacked=True,
              description="free: unused; private: one request; shared: several requests or a "
                          "request and the cache; cached: only the cache (evictable)."),
        panel("KV memory by state",
              [(f"sum by (state) (kvshare_kv_memory_bytes{{{SEL}}})", "{{state}}")], "bytes",
              stacked=True),
        panel("KV usage and watermark",
              [(f"max(kvshare_kv_usage_watermark{{{SEL}}})", "watermark (peak since start)"),
               (f"1 - {free} / {total}", "used (not free)"),
               (f"1 - {available} / {total}", "held by requests")], "percentunit",
              thresholds=[(0.95, "red")]),
        panel("Fragmentation", [(f"max(kvshare_kv_fragmentation_ratio{{{SEL}}})", "ratio")],
              "percentunit", "Allocated but unfilled token slots / allocated slots."),
        panel("Copy-on-write copies per second",
              [(sum_rate("kvshare_kv_cow_copies_total"), "copies/s")], "ops"),
        panel("Evictions per second",
              [(sum_rate("kvshare_kv_evictions_total"), "evictions/s")], "ops"),
    ]  # fmt: skip


def latency_panels() -> list[dict]:
    return [
        panel("Time to first token", latency_targets("kvshare_time_to_first_token_seconds"), "s"),
        panel("Inter-token latency", latency_targets("kvshare_inter_token_latency_seconds"), "s"),
        panel("Request latency", latency_targets("kvshare_request_duration_seconds"), "s"),
        panel("Engine step duration", latency_targets("kvshare_step_duration_seconds"), "s"),
    ]


def traffic_panels() -> list[dict]:
    return [
        panel("Token throughput",
              [(sum_rate("kvshare_prompt_tokens_total"), "prompt"),
               (sum_rate("kvshare_prefill_tokens_total"), "prefill (computed)"),
               (sum_rate("kvshare_generation_tokens_total"), "generation")], "tps",
              "prompt - prefill = prompt tokens served from the prefix cache."),
        panel("Requests running and waiting",
              [(f"sum by (state) (kvshare_requests{{{SEL}}})", "{{state}}")]),
        panel("Finished requests per second",
              [(f"sum by (finish_reason) ({rate('kvshare_requests_total')})", "{{finish_reason}}")],
              "reqps"),
        panel("Preemptions per second",
              [(sum_rate("kvshare_preemptions_total"), "preemptions/s")], "ops"),
        panel("Batch size (sequences per step)", latency_targets("kvshare_batch_size")),
        panel("Steps scheduled ahead per second",
              [(sum_rate("kvshare_lookahead_steps_total"), "lookahead steps/s")], "ops",
              "Async scheduling (on with CUDA): decode steps scheduled and queued before the "
              "step in front of them returned its tokens; near the step rate in steady "
              "decoding, 0 on the CPU."),
    ]  # fmt: skip


def router_panels() -> list[dict]:
    """Per replica, the figures an endpoint picker compares (deploy/k8s/gateway/)."""

    def per_replica(selector: str) -> str:
        return f"sum by (instance) ({selector})"

    usage = per_replica(f"kvshare_kv_usage_ratio{{{SEL}}}")
    waiting = per_replica(f'kvshare_requests{{{SEL},state="waiting"}}')
    running = per_replica(f'kvshare_requests{{{SEL},state="running"}}')
    pool = f"max by (instance, block_size, num_gpu_blocks) (kvshare_cache_config_info{{{SEL}}})"
    return [
        panel("KV usage per replica", [(usage, "{{instance}}")], "percentunit",
              "Blocks held by requests / all blocks; cached-only blocks count as free (they are "
              "evicted on demand). The picker sends work where this is low.",
              thresholds=[(0.95, "red")]),
        panel("Queue per replica", [(waiting, "{{instance}} waiting"),
                                    (running, "{{instance}} running")],
              description="Waiting and running requests: the picker's queue and load."),
        panel("KV pool per replica",
              [(pool, "{{instance}}: {{num_gpu_blocks}} blocks of {{block_size}} tokens")],
              kind="stat", text_mode="name",
              description="kvshare_cache_config_info: what the picker's prefix scorer sizes "
                          "itself by."),
    ]  # fmt: skip


def tenant_panels() -> list[dict]:
    """Fair share between tenants (docs/fair-scheduling.md); tenants are short hashes."""
    per_tenant = "sum by (tenant) ({})"
    queue_p99 = (
        "histogram_quantile(0.99, sum by (le, tenant) "
        f"({rate('kvshare_tenant_queue_time_seconds_bucket')}))"
    )
    rejections = f"sum by (tenant, reason) ({rate('kvshare_tenant_rejections_total')})"
    return [
        panel("Output tokens per tenant",
              [(per_tenant.format(rate("kvshare_tenant_generation_tokens_total")), "{{tenant}}")],
              "tps", "Generated tokens of ended requests per second, by tenant (other: past "
              "max_tenant_labels).", stacked=True),
        panel("Queue time per tenant (p99)", [(queue_p99, "{{tenant}}")], "s",
              "Arrival to first output: what a noisy neighbour adds."),
        panel("Fair-share counter spread",
              [(f"max(kvshare_fair_share_counter_spread{{{SEL}}})", "spread")],
              description="Largest minus least weighted service among the tracked tenants."),
        panel("Per-tenant 429s", [(rejections, "{{tenant}} {{reason}}")], "reqps",
              "Requests refused by a per-tenant limit, by reason."),
        panel("Prompt tokens per tenant",
              [(per_tenant.format(rate("kvshare_tenant_prompt_tokens_total")), "{{tenant}}")],
              "tps", stacked=True),
    ]  # fmt: skip


def tier_panels() -> list[dict]:
    """The second KV tier (docs/kv-tier.md): what it serves, what it costs, that it verifies."""
    hits = "kvshare_prefix_cache_tier_hits_total"
    tier_hits = sum_rate(hits, 'tier=~"disk|host"')

    def per_tier(gauge: str) -> str:
        return f"sum by (tier) ({gauge}{{{SEL}}})"

    def total(gauge: str) -> str:
        return f"sum({gauge}{{{SEL}}})"

    return [
        panel("Prompt tokens served per tier",
              [(f"sum by (tier) ({rate(hits)})", "{{tier}}")], "tps",
              "Prompt tokens per second served from the prefix cache, by where their KV came "
              "from: pool (the KV pool) or the second tier (disk, host).", stacked=True),
        panel("Tier hit share",
              [(f"{tier_hits} / {sum_rate(hits)}", "of cache hits"),
               (f"{tier_hits} / {sum_rate('kvshare_prefix_cache_queries_total')}",
                "of prompt tokens")], "percentunit",
              "Prompt tokens loaded from the second tier instead of computed."),
        panel("Tier blocks per second",
              [(sum_rate("kvshare_kv_tier_loaded_blocks_total"), "loaded"),
               (sum_rate("kvshare_kv_tier_stored_blocks_total"), "stored")], "ops",
              "Blocks loaded back into the pool (verified) and blocks written to the tier."),
        panel("Tier load latency", latency_targets("kvshare_kv_tier_load_seconds"), "s",
              "One admission's run of consecutive blocks, read and verified."),
        panel("Tier entries failing verification",
              [(sum_rate("kvshare_kv_tier_checksum_failures_total"), "checksum"),
               (sum_rate("kvshare_kv_tier_refused_entries_total"),
                "refused (fingerprint, namespace, tokens)")], "ops",
              "Entries dropped on load instead of served; their tokens are recomputed. Alert: "
              "KvshareKVTierEntriesRejected.", thresholds=[(1e-9, "red")]),
        panel("Restore audits",
              [(sum_rate("kvshare_cache_restore_audits_total"), "audits/s"),
               (sum_rate("kvshare_cache_restore_audit_corruptions_total"), "corruptions/s")],
              "ops", "Shadow audits of hits that loaded from the tier "
              "(audit_restored_sample_rate). Corruptions must stay 0.",
              thresholds=[(1e-9, "red")]),
        panel("Tier bytes", [(per_tier("kvshare_kv_tier_bytes"), "{{tier}}")], "bytes",
              "Bytes of the tier's entries, bounded by kv_tier_max_bytes."),
        panel("Tier entries", [(per_tier("kvshare_kv_tier_entries"), "{{tier}}")],
              description="One entry per prefix-cache block the tier holds."),
        panel("Tier entries lost",
              [(sum_rate("kvshare_kv_tier_dropped_entries_total"), "dropped for room"),
               (sum_rate("kvshare_kv_tier_missing_entries_total"), "missing"),
               (sum_rate("kvshare_kv_tier_spills_lost_total"), "spills lost")], "ops",
              "Dropped for room: kv_tier_max_bytes or a namespace's cap. Missing: indexed but "
              "gone from the store. Spills lost: evicted blocks whose step failed."),
        panel("Entries restored at start",
              [(total("kvshare_kv_tier_restored_entries"), "restored"),
               (total("kvshare_kv_tier_ignored_entries"), "removed (foreign, unreadable)")],
              kind="stat", text_mode="value_and_name",
              description="Warm restart: entries a previous process left, indexed at start."),
    ]  # fmt: skip


def layout(rows: list[tuple[str, list[dict]]], width: int = 8, height: int = 8) -> list[dict]:
    """Rows of panels, three per line; ids and gridPos assigned in reading order."""
    panels, y, next_id = [], 0, 1
    for row_title, row_panels in rows:
        panels.append({"type": "row", "title": row_title, "collapsed": False, "id": next_id,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})  # fmt: skip
        next_id, y = next_id + 1, y + 1
        for i, item in enumerate(row_panels):
            x = (i % (24 // width)) * width
            if i and x == 0:
                y += height
            item["id"], next_id = next_id, next_id + 1
            item["gridPos"] = {"x": x, "y": y, "w": width, "h": height}
            panels.append(item)
        y += height
    return panels


def templating() -> dict:
    instance_query = "label_values(kvshare_kv_blocks_total, instance)"
    return {
        "list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "instance", "label": "Instance", "type": "query", "datasource": DATASOURCE,
             "query": {"query": instance_query, "refId": "instance"},
             "definition": instance_query, "refresh": 2, "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1},
        ]
    }  # fmt: skip


def build_dashboard() -> dict:
    rows = [
        ("Prefix cache: does sharing pay, is it safe?", cache_panels()),
        ("KV memory", memory_panels()),
        ("KV tier", tier_panels()),
        ("Latency", latency_panels()),
        ("Traffic and scheduling", traffic_panels()),
        ("Router view: what the endpoint picker compares", router_panels()),
        ("Tenants: fair share, queue time, limits", tenant_panels()),
    ]
    return {
        "uid": "kvshare",
        "title": "kvshare",
        "description": "Prefix-cache sharing, KV memory, latency and throughput of kvshare.",
        "tags": ["kvshare", "llm", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": templating(),
        "annotations": {"list": []},
        "panels": layout(rows),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the kvshare Grafana dashboard.")
    parser.add_argument("--check", action="store_true", help="fail if kvshare.json is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
