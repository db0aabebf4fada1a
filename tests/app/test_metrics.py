"""/metrics: every metric the docs list, engine numbers refreshed at scrape time."""

from __future__ import annotations

import re

import pytest
from fake_engine import FakeEngine
from helpers import chat_body
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import ServerMetrics
from engine.core.protocol import EngineStats, StepSample
from tests.deploy.referenced_metrics import referenced_metrics

pytestmark = pytest.mark.anyio

# (name, type) as they appear in TYPE lines of the text exposition.
REQUIRED = [
    ("kvshare_prefix_cache_queries_total", "counter"),
    ("kvshare_prefix_cache_hits_total", "counter"),
    ("kvshare_cache_audits_total", "counter"),
    ("kvshare_cache_audit_mismatches_total", "counter"),
    ("kvshare_cache_audit_max_abs_diff", "histogram"),
    ("kvshare_cache_quarantined_blocks_total", "counter"),
    ("kvshare_kv_blocks", "gauge"),
    ("kvshare_kv_blocks_total", "gauge"),
    ("kvshare_kv_memory_bytes", "gauge"),
    ("kvshare_kv_usage_watermark", "gauge"),
    ("kvshare_kv_fragmentation_ratio", "gauge"),
    ("kvshare_kv_cow_copies_total", "counter"),
    ("kvshare_kv_evictions_total", "counter"),
    ("kvshare_kv_blocks_leaked", "gauge"),
    ("kvshare_kv_usage_ratio", "gauge"),
    ("kvshare_cache_config_info", "gauge"),
    ("kvshare_requests", "gauge"),
    ("kvshare_requests_total", "counter"),
    ("kvshare_preemptions_total", "counter"),
    ("kvshare_prompt_tokens_total", "counter"),
    ("kvshare_prefill_tokens_total", "counter"),
    ("kvshare_generation_tokens_total", "counter"),
    ("kvshare_time_to_first_token_seconds", "histogram"),
    ("kvshare_inter_token_latency_seconds", "histogram"),
    ("kvshare_request_duration_seconds", "histogram"),
    ("kvshare_step_duration_seconds", "histogram"),
    ("kvshare_batch_size", "histogram"),
    ("kvshare_structured_requests_total", "counter"),
    ("kvshare_grammar_cache_hits_total", "counter"),
    ("kvshare_grammar_compile_failures_total", "counter"),
    ("kvshare_grammar_compile_seconds", "histogram"),
    ("kvshare_grammar_mask_seconds", "histogram"),
    ("kvshare_prefix_cache_miss_tokens_total", "counter"),
    ("kvshare_prefix_cache_divergence_total", "counter"),
    ("kvshare_chat_template_append_only", "gauge"),
    ("kvshare_prefix_cache_tier_hits_total", "counter"),
    ("kvshare_kv_tier_stored_blocks_total", "counter"),
    ("kvshare_kv_tier_loaded_blocks_total", "counter"),
    ("kvshare_kv_tier_load_seconds", "histogram"),
    ("kvshare_kv_tier_checksum_failures_total", "counter"),
    ("kvshare_kv_tier_refused_entries_total", "counter"),
    ("kvshare_kv_tier_missing_entries_total", "counter"),
    ("kvshare_kv_tier_dropped_entries_total", "counter"),
    ("kvshare_kv_tier_spills_lost_total", "counter"),
    ("kvshare_kv_tier_invalidated_entries_total", "counter"),
    ("kvshare_kv_tier_write_errors_total", "counter"),
    ("kvshare_cache_restore_audits_total", "counter"),
    ("kvshare_cache_restore_audit_corruptions_total", "counter"),
    ("kvshare_kv_tier_bytes", "gauge"),
    ("kvshare_kv_tier_entries", "gauge"),
    ("kvshare_kv_tier_restored_entries", "gauge"),
    ("kvshare_kv_tier_ignored_entries", "gauge"),
]


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)"
    match = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} missing"
    return float(match.group(1))


async def test_every_required_metric_is_exposed_with_help(client) -> None:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", response.text, re.MULTILINE))
    helps = dict(re.findall(r"^# HELP (\S+) (.+)$", response.text, re.MULTILINE))
    for name, kind in REQUIRED:
        assert types.get(name) == kind, name
        assert helps.get(name), name
    assert "process_cpu_seconds_total" in types


async def test_engine_stats_pushed_per_step_reach_the_scrape(client, engine: FakeEngine) -> None:
    engine.publish(
        EngineStats(
            num_running=3,
            num_waiting=2,
            num_total_blocks=10,
            num_free_blocks=4,
            num_private_blocks=3,
            num_shared_blocks=2,
            num_cached_blocks=1,
            bytes_per_block=1000,
            prefix_cache_queries=50,
            prefix_cache_hits=20,
            num_audits=7,
            num_audit_corruptions=1,
            num_audit_drifts=2,
            audit_max_abs_diffs=(0.5,),
        )
    )
    engine.publish_steps(StepSample(0.02, 4, 40), StepSample(0.03, 8, 8))
    text = (await client.get("/metrics")).text
    assert sample(text, "kvshare_requests", 'state="running"') == 3
    assert sample(text, "kvshare_requests", 'state="waiting"') == 2
    assert sample(text, "kvshare_kv_blocks", 'state="shared"') == 2
    assert sample(text, "kvshare_kv_memory_bytes", 'state="free"') == 4000
    assert sample(text, "kvshare_kv_blocks_total") == 10
    assert sample(text, "kvshare_prefix_cache_hits_total") == 20
    assert sample(text, "kvshare_cache_audit_mismatches_total", 'kind="corruption"') == 1
    assert sample(text, "kvshare_cache_audit_mismatches_total", 'kind="drift"') == 2
    assert sample(text, "kvshare_step_duration_seconds_count") == 2
    assert sample(text, "kvshare_batch_size_sum") == 12
    assert sample(text, "kvshare_cache_audit_max_abs_diff_count") == 1
    again = (await client.get("/metrics")).text  # a scrape observes nothing by itself
    assert sample(again, "kvshare_step_duration_seconds_count") == 2
    assert sample(again, "kvshare_cache_audit_max_abs_diff_count") == 1


async def test_router_gauges_follow_the_pushed_snapshot(client, engine: FakeEngine) -> None:
    text = (await client.get("/metrics")).text
    assert sample(text, "kvshare_kv_usage_ratio") == 0  # no pool yet
    assert "kvshare_cache_config_info{" not in text
    # 10 blocks: 2 free and 3 cached (evictable) are available; 4 private + 1 shared are held.
    engine.publish(
        EngineStats(
            num_total_blocks=10,
            num_free_blocks=2,
            num_private_blocks=4,
            num_shared_blocks=1,
            num_cached_blocks=3,
            block_size=32,
        )
    )
    text = (await client.get("/metrics")).text
    assert sample(text, "kvshare_kv_usage_ratio") == 0.5
    assert sample(text, "kvshare_cache_config_info", 'block_size="32",num_gpu_blocks="10"') == 1
    engine.publish(EngineStats(num_total_blocks=10, num_free_blocks=0, num_private_blocks=10))
    assert sample((await client.get("/metrics")).text, "kvshare_kv_usage_ratio") == 1


def labelled_samples(text: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    samples = set()
    for name, labels in re.findall(r"^(\w+)\{([^}]*)\} ", text, re.MULTILINE):
        samples.add((name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))))
    return samples


async def test_every_metric_the_examples_name_is_exported(client, engine: FakeEngine) -> None:
    """Acceptance: the endpoint picker's config and flags, the dashboard and the docs name only
    series the app exports (tests/deploy/referenced_metrics.py reads them)."""
    engine.publish(EngineStats(num_running=1, num_waiting=1, num_total_blocks=8, num_free_blocks=8))
    text = (await client.get("/metrics")).text
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    samples = labelled_samples(text)
    refs = referenced_metrics()
    sources = {ref.source.split(" [")[0].split(":")[0] for ref in refs}
    assert {"dashboard", "docs metrics table", "docs More than one replica"} <= sources
    assert any(ref.source.startswith("epp-config.yaml") for ref in refs)
    assert any("flag" in ref.source for ref in refs)
    missing = [ref for ref in refs if ref.name not in families]
    assert missing == []
    unmatched = [
        ref
        for ref in refs
        if ref.labels
        and not any(n == ref.name and set(ref.labels) <= labels for n, labels in samples)
    ]
    assert unmatched == []


async def test_request_metrics_are_observed(client) -> None:
    await client.post("/v1/chat/completions", json=chat_body())
    await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    text = (await client.get("/metrics")).text
    assert sample(text, "kvshare_requests_total", 'finish_reason="stop"') == 1
    assert sample(text, "kvshare_requests_total", 'finish_reason="length"') == 1
    assert sample(text, "kvshare_time_to_first_token_seconds_count") == 2
    assert sample(text, "kvshare_request_duration_seconds_count") == 2
    assert sample(text, "kvshare_inter_token_latency_seconds_count") > 0


def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_request("error", 1.0)
    assert 'kvshare_requests_total{finish_reason="error"} 1.0' in first.render().decode()
    assert 'kvshare_requests_total{finish_reason="error"} 0.0' in second.render().decode()


async def test_grammar_figures_pushed_per_step_reach_the_scrape(client, engine: FakeEngine) -> None:
    engine.publish(
        EngineStats(
            num_structured_json_object_requests=2,
            num_structured_json_schema_requests=5,
            num_structured_tool_calls_requests=3,
            num_grammar_cache_hits=4,
            num_grammar_compile_failures=1,
            grammar_compile_seconds=(0.02, 0.3),
            step=StepSample(0.05, 3, 3),
            grammar_mask_seconds=0.004,
        )
    )
    engine.publish_steps(StepSample(0.02, 1, 1))  # a step without constrained rows
    text = (await client.get("/metrics")).text
    assert sample(text, "kvshare_structured_requests_total", 'kind="json_object"') == 2
    assert sample(text, "kvshare_structured_requests_total", 'kind="json_schema"') == 5
    assert sample(text, "kvshare_structured_requests_total", 'kind="tool_calls"') == 3
    assert sample(text, "kvshare_grammar_cache_hits_total") == 4
    assert sample(text, "kvshare_grammar_compile_failures_total") == 1
    assert sample(text, "kvshare_grammar_compile_seconds_count") == 2
    assert sample(text, "kvshare_grammar_compile_seconds_sum") == pytest.approx(0.32)
    assert sample(text, "kvshare_grammar_mask_seconds_count") == 1


async def test_tenants_read_no_tenant_series_and_no_other_namespace_reason(engine) -> None:
    """With api_keys and no operator_keys anyone may scrape: no kvshare_tenant_* series, and
    misses another namespace could explain counted as no_earlier_prefix. With operator_keys,
    /metrics is the operator's and shows both."""
    from dataclasses import replace

    from helpers import chat_body, make_settings, open_client

    misses = (("other_namespace", 35), ("no_earlier_prefix", 5))
    keyed = {"Authorization": "Bearer k1"}
    async with open_client(engine, make_settings(api_keys=("k1",))) as client:
        await client.post("/v1/chat/completions", json=chat_body(), headers=keyed)
        metrics = client.app.state.kvshare.metrics
        metrics.observe_engine(replace(engine.stats(), prefix_cache_miss_tokens=misses))
        tenant_view = (await client.get("/metrics")).text
    assert "kvshare_tenant_" not in tenant_view
    assert 'kvshare_prefix_cache_miss_tokens_total{reason="other_namespace"} 0.0' in tenant_view
    assert 'kvshare_prefix_cache_miss_tokens_total{reason="no_earlier_prefix"} 40.0' in tenant_view
    settings = make_settings(api_keys=("k1",), operator_keys=("op",))
    async with open_client(engine, settings) as client:
        await client.post("/v1/chat/completions", json=chat_body(), headers=keyed)
        metrics = client.app.state.kvshare.metrics
        metrics.observe_engine(replace(engine.stats(), prefix_cache_miss_tokens=misses))
        assert (await client.get("/metrics", headers=keyed)).status_code == 401
        full = (await client.get("/metrics", headers={"x-api-key": "op"})).text
    assert "kvshare_tenant_prompt_tokens_total" in full
    assert 'kvshare_prefix_cache_miss_tokens_total{reason="other_namespace"} 35.0' in full


def parsed(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The exposition as prometheus_client parses it: sample name -> {sorted labels: value}."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


TIER_FIGURES = {  # unlabelled series -> EngineStats field
    "kvshare_kv_tier_stored_blocks_total": "num_tier_stored_blocks",
    "kvshare_kv_tier_loaded_blocks_total": "num_tier_loaded_blocks",
    "kvshare_kv_tier_checksum_failures_total": "num_tier_checksum_failures",
    "kvshare_kv_tier_refused_entries_total": "num_tier_refused_entries",
    "kvshare_kv_tier_missing_entries_total": "num_tier_missing_entries",
    "kvshare_kv_tier_dropped_entries_total": "num_tier_dropped_entries",
    "kvshare_kv_tier_spills_lost_total": "num_tier_spills_lost",
    "kvshare_kv_tier_invalidated_entries_total": "num_tier_invalidated_entries",
    "kvshare_kv_tier_write_errors_total": "num_tier_write_errors",
    "kvshare_cache_restore_audits_total": "num_restore_audits",
    "kvshare_cache_restore_audit_corruptions_total": "num_restore_audit_corruptions",
    "kvshare_kv_tier_restored_entries": "num_tier_restored_at_start",
    "kvshare_kv_tier_ignored_entries": "num_tier_ignored_at_start",
}


def tier_stats(**fields) -> EngineStats:
    """A disk tier's snapshot: each counter a distinct number, so a swapped field shows."""
    counters = {field: 3 + i for i, field in enumerate(TIER_FIGURES.values())}
    tier = {"kv_tier": "disk", "kv_tier_bytes": 6_000_000, "kv_tier_entries": 40}
    hits = {"prefix_cache_queries": 500, "prefix_cache_hits": 320, "prefix_cache_tier_hits": 192}
    return EngineStats(num_audits=9, **hits | tier | counters | fields)


async def test_tier_figures_reach_the_scrape_per_tier(client, engine: FakeEngine) -> None:
    engine.publish(tier_stats(tier_load_seconds=(0.0003, 0.02)))
    engine.publish(tier_stats(tier_load_seconds=(0.004,)))
    engine.publish_steps(StepSample(0.02, 1, 1))  # the same figures again, no new loads
    samples = parsed((await client.get("/metrics")).text)
    hits = samples["kvshare_prefix_cache_tier_hits_total"]
    assert hits == {(("tier", "pool"),): 128, (("tier", "disk"),): 192}
    assert sum(hits.values()) == samples["kvshare_prefix_cache_hits_total"][()]
    assert samples["kvshare_kv_tier_bytes"] == {(("tier", "disk"),): 6e6, (("tier", "host"),): 0}
    assert samples["kvshare_kv_tier_entries"] == {(("tier", "disk"),): 40, (("tier", "host"),): 0}
    stats = engine.stats()
    for name, field in TIER_FIGURES.items():
        assert samples[name] == {(): getattr(stats, field)}, name
    assert samples["kvshare_kv_tier_load_seconds_count"] == {(): 3}
    assert samples["kvshare_kv_tier_load_seconds_sum"][()] == pytest.approx(0.0243)
    buckets = {
        dict(labels)["le"]: n
        for labels, n in samples["kvshare_kv_tier_load_seconds_bucket"].items()
    }
    assert (buckets["0.00025"], buckets["0.005"], buckets["0.025"]) == (0, 2, 3)


async def test_without_a_tier_its_series_stay_at_zero(client, engine: FakeEngine) -> None:
    """Tier off: tokens come only from the pool; every other tier series exists at 0, so the
    dashboard and the alerts select the same series with the tier on or off."""
    engine.publish(EngineStats(prefix_cache_queries=50, prefix_cache_hits=20, num_audits=2))
    samples = parsed((await client.get("/metrics")).text)
    assert samples["kvshare_prefix_cache_tier_hits_total"] == {(("tier", "pool"),): 20}
    for name in TIER_FIGURES:
        assert samples[name] == {(): 0}, name
    for name in ("kvshare_kv_tier_bytes", "kvshare_kv_tier_entries"):
        assert samples[name] == {(("tier", "disk"),): 0, (("tier", "host"),): 0}
    assert samples["kvshare_kv_tier_load_seconds_count"] == {(): 0}


async def test_a_host_tier_is_labelled_host(client, engine: FakeEngine) -> None:
    engine.publish(tier_stats(kv_tier="host", kv_tier_bytes=1024, kv_tier_entries=2))
    samples = parsed((await client.get("/metrics")).text)
    hits = samples["kvshare_prefix_cache_tier_hits_total"]
    assert hits == {(("tier", "pool"),): 128, (("tier", "host"),): 192}
    assert samples["kvshare_kv_tier_bytes"] == {(("tier", "disk"),): 0, (("tier", "host"),): 1024}
