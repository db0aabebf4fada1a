"""deploy/prometheus: promtool accepts the config and the rules, and each alert fires exactly
when it should (promtool's rule unit tests over synthetic series)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
PROMETHEUS_RULE = REPO_ROOT / "deploy" / "k8s" / "prometheusrule.yaml"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is missing: run scripts/install_prometheus.sh (Debian package prometheus)",
)

A = {"instance": "a:8000", "job": "kvshare"}
B = {"instance": "b:8000", "job": "kvshare"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


def _series(name: str, labels: dict, values: str) -> dict:
    selector = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{selector}}}", "values": values}


def _case(alertname: str, series: list[dict], firing: dict[str, list[dict]]) -> dict:
    """firing maps an eval time ("4m") to the label sets expected firing then ([] = none)."""
    return {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {
                "eval_time": eval_time,
                "alertname": alertname,
                "exp_alerts": [{"exp_labels": labels} for labels in expected],
            }
            for eval_time, expected in firing.items()
        ],
    }


def _crit(labels: dict, **extra: str) -> dict:
    return {**labels, **extra, "severity": "critical"}


def _warn(labels: dict, **extra: str) -> dict:
    return {**labels, **extra, "severity": "warning"}


def _kv_blocks(labels: dict, free: int, cached: int, private: int, shared: int) -> list[dict]:
    counts = {"free": free, "cached": cached, "private": private, "shared": shared}
    series = [
        _series("kvshare_kv_blocks", {**labels, "state": s}, f"{n}x20") for s, n in counts.items()
    ]
    return [*series, _series("kvshare_kv_blocks_total", labels, f"{sum(counts.values())}x20")]


def _requests(labels: dict, per_minute: dict[str, int]) -> list[dict]:
    return [
        _series("kvshare_requests_total", {**labels, "finish_reason": reason}, f"0+{n}x20")
        for reason, n in per_minute.items()
    ]


def _prompt_tokens(labels: dict, queries: int, hits: int, diverged: int, other: int) -> list:
    misses = "kvshare_prefix_cache_miss_tokens_total"
    return [
        _series("kvshare_prefix_cache_queries_total", labels, f"0+{queries}x40"),
        _series("kvshare_prefix_cache_hits_total", labels, f"0+{hits}x40"),
        _series(misses, {**labels, "reason": "diverged"}, f"0+{diverged}x40"),
        _series(misses, {**labels, "reason": "no_earlier_prefix"}, f"0+{other}x40"),
    ]


CASES = [
    _case(
        "KvshareCacheCorruption",
        [
            _series(
                "kvshare_cache_audit_mismatches_total",
                {**A, "kind": "corruption"},
                "0 0 0 1 1 1 1 1 1 1 1 1",
            ),
            _series("kvshare_cache_audit_mismatches_total", {**B, "kind": "drift"}, "0+1x11"),
        ],
        {"2m": [], "4m": [_crit(A, kind="corruption")], "10m": []},
    ),
    _case(
        "KvshareCacheRestoreCorruption",
        [
            _series("kvshare_cache_restore_audit_corruptions_total", A, "0 0 0 1 1 1 1 1 1 1 1 1"),
            _series("kvshare_cache_restore_audit_corruptions_total", B, "0x11"),
        ],
        {"2m": [], "4m": [_crit(A)], "10m": []},
    ),
    _case(
        "KvshareKVTierEntriesRejected",
        # a: one checksum failure at 3m; b: one refused entry at 6m; neither otherwise.
        [
            _series("kvshare_kv_tier_checksum_failures_total", A, "0 0 0 1 1 1 1 1 1 1 1 1"),
            _series("kvshare_kv_tier_refused_entries_total", A, "0x11"),
            _series("kvshare_kv_tier_checksum_failures_total", B, "0x11"),
            _series("kvshare_kv_tier_refused_entries_total", B, "0 0 0 0 0 0 1 1 1 1 1 1"),
        ],
        {"2m": [], "4m": [_warn(A)], "7m": [_warn(A), _warn(B)], "10m": [_warn(B)]},
    ),
    _case(
        "KvshareKVBlocksLeaked",
        [
            _series("kvshare_kv_blocks_leaked", A, "0 0 2 2"),
            _series("kvshare_kv_blocks_leaked", B, "0x3"),
        ],
        {"1m": [], "2m": [_crit(A)]},
    ),
    _case(
        "KvshareKVCacheNearlyFull",
        # a: requests hold 97 of 100 blocks. b: 88 held, 10 cached (evictable): no alert.
        _kv_blocks(A, free=2, cached=1, private=90, shared=7)
        + _kv_blocks(B, free=2, cached=10, private=80, shared=8),
        {"4m": [], "6m": [_warn(A)]},
    ),
    _case(
        "KvshareWaitingRequestsGrowing",
        [
            _series("kvshare_requests", {**A, "state": "waiting"}, "0+1x20"),
            _series("kvshare_requests", {**B, "state": "waiting"}, "5x20"),
        ],
        {"3m": [], "8m": [_warn(A, state="waiting")]},
    ),
    _case(
        "KvshareHighErrorRate",
        # a: 2 errors per 102 requests (2%); b: 1 per 1001 (0.1%).
        _requests(A, {"stop": 100, "error": 2}) + _requests(B, {"length": 1000, "error": 1}),
        {"1m": [], "10m": [_warn(A)]},
    ),
    _case(
        "KvsharePromptsDivergeEarly",
        # a: 90 of 100 prompt tokens a minute miss, 80 of them diverged (hit rate 10%).
        # b: the same misses, but 60 of 100 tokens hit: the cache works, no alert.
        _prompt_tokens(A, queries=100, hits=10, diverged=80, other=10)
        + _prompt_tokens(B, queries=100, hits=60, diverged=30, other=10),
        {"5m": [], "30m": [_warn(A)]},
    ),
    _case(
        "KvshareDown",
        [_series("up", A, "1 1 0 0 0 0"), _series("up", B, "1x5")],
        {"2m": [], "4m": [_crit(A)]},
    ),
]


def test_alert_cases_cover_every_rule():
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    names = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tested = {case["alert_rule_test"][0]["alertname"] for case in CASES}
    assert tested == names


@needs_promtool
def test_promtool_check_config():
    result = _promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_rules():
    result = _promtool("check", "rules", str(PROMETHEUS_DIR / "alerts.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alerts_fire_exactly_when_expected(tmp_path):
    # promtool compares annotations too; they are prose (checked by `check rules`), so the
    # unit test runs on a copy of the rules without them.
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    spec = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": CASES}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(spec))
    result = _promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_crd_carries_the_same_groups():
    alerts = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    crd = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (crd["apiVersion"], crd["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert crd["spec"]["groups"] == alerts["groups"]


def test_scrape_config_targets_the_kvshare_service_and_loads_the_rules():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvshare"
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["kvshare:8000"]}]
