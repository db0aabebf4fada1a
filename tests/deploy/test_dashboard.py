"""deploy/grafana and the PromQL they share with the alert rules: the generated dashboard is up
to date, and every metric the dashboard, the rules and the autoscaler read is one that
the docs list as exported by kvshare. (The metrics integration test checks the same
expressions against a live /metrics through a real Prometheus.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from deploy.grafana import build_dashboard
from engine.core.protocol import CACHE_MISS_REASONS
from tests.deploy.promql import (
    alert_expressions,
    all_expressions,
    dashboard_expressions,
    metric_names,
    substitute_variables,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO_ROOT / "deploy" / "grafana"
ADAPTER_VALUES = REPO_ROOT / "deploy" / "k8s" / "prometheus-adapter" / "values.yaml"

# The docs' metrics list (docs/metrics.md): every metric kvshare must export, with its type.
REQUIRED_METRICS = {
    "kvshare_prefix_cache_queries_total": "counter",
    "kvshare_prefix_cache_hits_total": "counter",
    "kvshare_cache_audits_total": "counter",
    "kvshare_cache_audit_mismatches_total": "counter",
    "kvshare_cache_audit_max_abs_diff": "histogram",
    "kvshare_cache_quarantined_blocks_total": "counter",
    "kvshare_kv_blocks": "gauge",
    "kvshare_kv_blocks_total": "gauge",
    "kvshare_kv_memory_bytes": "gauge",
    "kvshare_kv_usage_watermark": "gauge",
    "kvshare_kv_fragmentation_ratio": "gauge",
    "kvshare_kv_cow_copies_total": "counter",
    "kvshare_kv_evictions_total": "counter",
    "kvshare_kv_blocks_leaked": "gauge",
    "kvshare_kv_usage_ratio": "gauge",  # for routers: docs/deployment.md "More than one replica"
    "kvshare_cache_config_info": "gauge",
    "kvshare_requests": "gauge",
    "kvshare_requests_total": "counter",
    "kvshare_preemptions_total": "counter",
    "kvshare_lookahead_steps_total": "counter",
    "kvshare_prompt_tokens_total": "counter",
    "kvshare_prefill_tokens_total": "counter",
    "kvshare_generation_tokens_total": "counter",
    "kvshare_time_to_first_token_seconds": "histogram",
    "kvshare_inter_token_latency_seconds": "histogram",
    "kvshare_request_duration_seconds": "histogram",
    "kvshare_step_duration_seconds": "histogram",
    "kvshare_batch_size": "histogram",
    "kvshare_prefix_cache_miss_tokens_total": "counter",  # docs/cache-diagnostics.md
    "kvshare_prefix_cache_divergence_total": "counter",
    # Fair share (docs/fair-scheduling.md)
    "kvshare_tenant_generation_tokens_total": "counter",
    "kvshare_tenant_prompt_tokens_total": "counter",
    "kvshare_tenant_queue_time_seconds": "histogram",
    "kvshare_tenant_rejections_total": "counter",
    "kvshare_fair_share_counter_spread": "gauge",
    # The second KV tier (docs/kv-tier.md)
    "kvshare_prefix_cache_tier_hits_total": "counter",
    "kvshare_kv_tier_loaded_blocks_total": "counter",
    "kvshare_kv_tier_stored_blocks_total": "counter",
    "kvshare_kv_tier_load_seconds": "histogram",
    "kvshare_kv_tier_checksum_failures_total": "counter",
    "kvshare_kv_tier_refused_entries_total": "counter",
    "kvshare_kv_tier_missing_entries_total": "counter",
    "kvshare_kv_tier_dropped_entries_total": "counter",
    "kvshare_kv_tier_spills_lost_total": "counter",
    "kvshare_cache_restore_audits_total": "counter",
    "kvshare_cache_restore_audit_corruptions_total": "counter",
    "kvshare_kv_tier_bytes": "gauge",
    "kvshare_kv_tier_entries": "gauge",
    "kvshare_kv_tier_restored_entries": "gauge",
    "kvshare_kv_tier_ignored_entries": "gauge",
}
# Label values the expressions may match on (docs/metrics.md, FinishReason).
LABEL_VALUES = {
    "state": {"free", "private", "shared", "cached", "running", "waiting"},
    "kind": {"corruption", "drift"},
    "finish_reason": {"stop", "length", "abort", "error"},
    "reason": set(CACHE_MISS_REASONS) | {"running", "waiting", "prompt_tokens"},
    "tier": {"pool", "disk", "host"},
}


def _dashboard() -> dict:
    return json.loads((GRAFANA_DIR / "kvshare.json").read_text())


def test_checked_in_dashboard_matches_its_generator():
    assert (GRAFANA_DIR / "kvshare.json").read_text() == build_dashboard.render(), (
        "run: python deploy/grafana/build_dashboard.py"
    )


def test_substitute_variables():
    variables = {"__rate_interval": "1m", "instance": ".*"}
    query = 'rate(x{instance=~"$instance"}[$__rate_interval]) + y{i="${instance}"}'
    assert substitute_variables(query, variables) == 'rate(x{instance=~".*"}[1m]) + y{i=".*"}'
    with pytest.raises(KeyError, match=r"\$job"):
        substitute_variables("up{job=~'$job'}", variables)


def test_expressions_are_extracted_from_every_panel_and_rule():
    dashboard = _dashboard()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = dashboard_expressions(dashboard, rate_interval="30s")
    assert len(exprs) == sum(len(p["targets"]) for p in panels)
    assert not any("$" in e.query for e in exprs)
    assert "[30s]" in exprs[0].query
    assert exprs[0].source == "dashboard: Prefix-cache hit rate [A]"
    alerts = alert_expressions()
    assert alerts[0].source == "alert: KvshareCacheCorruption"
    assert alerts[0].query == (
        'increase(kvshare_cache_audit_mismatches_total{kind="corruption"}[5m]) > 0'
    )
    assert not any("\n" in e.query for e in alerts)
    assert all_expressions() == dashboard_expressions() + alerts


def test_metric_names_strip_histogram_suffixes():
    query = "histogram_quantile(0.5, rate(kvshare_batch_size_bucket[1m])) / kvshare_kv_blocks_total"
    assert metric_names(query) == {"kvshare_batch_size", "kvshare_kv_blocks_total"}


def _shipped_queries() -> list[str]:
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    templating = [v["definition"] for v in _dashboard()["templating"]["list"] if "definition" in v]
    return [e.query for e in all_expressions()] + [r["seriesQuery"] for r in adapter] + templating


def test_every_metric_used_is_required_by_the_design():
    used = set().union(*(metric_names(q) for q in _shipped_queries()))
    assert used - REQUIRED_METRICS.keys() == set()


def test_dashboard_shows_every_required_metric():
    used = set().union(*(metric_names(e.query) for e in dashboard_expressions()))
    assert REQUIRED_METRICS.keys() - used == set()


def test_histograms_are_read_through_buckets_and_only_histograms_are():
    for query in _shipped_queries():
        for name in re.findall(r"\bkvshare_\w+", query):
            base = name.removesuffix("_bucket")
            if name != base:
                assert REQUIRED_METRICS.get(base) == "histogram", f"{name} in {query}"
            else:
                assert REQUIRED_METRICS.get(name) != "histogram", f"bare histogram in {query}"


def test_counters_are_read_through_rate_or_increase():
    counter_names = [n for n, kind in REQUIRED_METRICS.items() if kind == "counter"]
    for query in _shipped_queries():
        for name in counter_names:
            for match in re.finditer(rf"\b{name}\b", query):
                before = query[: match.start()]
                # Quarantined blocks are shown as a running total on purpose.
                if name != "kvshare_cache_quarantined_blocks_total":
                    assert re.search(r"\b(rate|increase)\($", before), f"{name} raw in {query}"


def test_label_values_match_the_design():
    for query in _shipped_queries():
        for label, value in re.findall(r'\b(state|kind|finish_reason|tier)=~?"([^"]*)"', query):
            assert set(value.split("|")) <= LABEL_VALUES[label], query


def test_provisioning_points_at_the_dashboard_and_prometheus():
    datasources = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (datasource,) = datasources["datasources"]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    providers = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "dashboards" / "kvshare.yml").read_text()
    )
    (provider,) = providers["providers"]
    compose = yaml.safe_load((REPO_ROOT / "deploy" / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/kvshare.json:{provider['options']['path']}/kvshare.json:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_panels_have_unique_ids_and_stay_on_the_grid():
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    for panel in panels:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
