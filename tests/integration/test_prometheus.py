"""A real Prometheus scrapes a real kvshare server and evaluates every shipped PromQL expression.

Prometheus comes from the Debian package `prometheus` (scripts/install_prometheus.sh); it runs
on 127.0.0.1 with a free port, a 1 s scrape interval, the shipped alert rules and a temporary
TSDB. A short workload shares one long system prompt, so the prefix-cache, KV-memory and
latency series all move before the dashboard's and the rules' expressions are queried.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.promql import (
    ALERTS_PATH,
    REPO_ROOT,
    Expression,
    alert_expressions,
    all_expressions,
    metric_names,
)
from tests.integration.server import free_port, running_server, scrape

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not on PATH: run scripts/install_prometheus.sh",
    ),
]

SHIPPED_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
RATE_INTERVAL = "30s"  # stands in for Grafana's $__rate_interval: many 1 s scrapes per window
BLOCK_STATES = {"free", "private", "shared", "cached"}
_COMPARISON_WITH_NUMBER = re.compile(r"(==|!=|>=|<=|>|<)\s*(?=-?\d)")

# About 200 tokens, identical in every request: whole 16-token blocks of it are reusable.
SYSTEM_PROMPT = (
    "You are the support assistant of a small public library in a coastal town. The library "
    "opens from nine in the morning until six in the evening on weekdays, and from ten until "
    "four on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to "
    "eight books, four magazines and two films at a time. Books are lent for three weeks, "
    "magazines for one week and films for four days. A loan can be renewed twice, online or "
    "at the front desk, unless another member has reserved the item. Late returns cost ten "
    "cents per day for books and magazines and fifty cents per day for films. Children under "
    "twelve never pay late fees. The reading room on the first floor is quiet at all times; "
    "the study rooms can be booked for two hours a day. Answer briefly, politely and only "
    "about the library; when you do not know an answer, ask the member to call the desk."
)
QUESTIONS = (
    "When do you open on Saturday?",
    "How many films can I borrow?",
    "Can I renew a book twice?",
    "What does a late film cost?",
    "Do children pay late fees?",
    "Where is the reading room?",
    "How long can I book a study room?",
    "Are you open on Sunday?",
    "How long is a magazine loan?",
    "How do I renew a loan?",
)


@dataclass(frozen=True)
class Live:
    server_url: str
    prometheus_url: str
    target: str  # host:port, Prometheus's `instance` label


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def prometheus_config(target: str) -> dict:
    """The shipped scrape config, pointed at `target`, scraping and evaluating every second."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS_PATH)]  # the shipped rules, unchanged
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvshare"  # KvshareDown selects up{job="kvshare"}
    job["static_configs"] = [{"targets": [target]}]
    return config


@contextmanager
def running_prometheus(target: str, workdir: Path) -> Iterator[str]:
    """Start Prometheus scraping `target`; yield its base URL once the target is up."""
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(target)))
    url = f"http://127.0.0.1:{free_port()}"
    command = [
        PROMETHEUS,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}",
    ]
    with (workdir / "prometheus.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _ready(url, process, workdir), "Prometheus /-/ready", 30)
            wait_for(lambda: _target_health(url) == "up", f"target {target} up", 30)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _ready(url: str, process: subprocess.Popen, workdir: Path) -> bool:
    if process.poll() is not None:
        log = (workdir / "prometheus.log").read_text()[-4000:]
        raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log}")
    return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200


def _target_health(url: str) -> str | None:
    targets = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    return targets[0]["health"] if targets else None


def query(prometheus_url: str, promql: str) -> dict:
    """The decoded /api/v1/query answer (an instant query at the current time)."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": promql}, timeout=10)
    return response.json()


def query_vector(live: Live, expression: Expression) -> list[dict]:
    answer = query(live.prometheus_url, expression.query)
    assert answer["status"] == "success", (expression.source, answer)
    assert answer["data"]["resultType"] == "vector", expression.source
    return answer["data"]["result"]


def run_shared_prefix_workload(server_url: str) -> None:
    """Sequential chats: the first computes the system prompt, the others can reuse it."""
    with httpx.Client(base_url=server_url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for question in QUESTIONS:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ]
            body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text


def _scraped_requests(prometheus_url: str) -> float:
    result = query(prometheus_url, 'sum(kvshare_requests_total{job="kvshare"})')["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def _rules_evaluated(prometheus_url: str) -> bool:
    groups = httpx.get(f"{prometheus_url}/api/v1/rules", timeout=5).json()["data"]["groups"]
    return all(rule["health"] != "unknown" for group in groups for rule in group["rules"])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """Server and Prometheus up, the workload done and scraped, every rule evaluated once."""
    workdir = tmp_path_factory.mktemp("prometheus")
    with running_server() as server_url:
        target = server_url.removeprefix("http://")
        with running_prometheus(target, workdir) as prometheus_url:
            run_shared_prefix_workload(server_url)
            wait_for(
                lambda: _scraped_requests(prometheus_url) == len(QUESTIONS),
                "Prometheus to scrape the finished workload",
                30,
            )
            time.sleep(3)  # a few more scrapes: rate() windows see the counters settle
            wait_for(lambda: _rules_evaluated(prometheus_url), "every rule evaluated", 15)
            yield Live(server_url, prometheus_url, target)


def panel_expressions(live: Live, title: str) -> list[Expression]:
    found = [
        expression
        for expression in all_expressions(RATE_INTERVAL, live.target)
        if expression.source.startswith(f"dashboard: {title} [")
    ]
    assert found, f"no dashboard panel titled {title!r}"
    return found


def single_value(live: Live, expression: Expression) -> float:
    result = query_vector(live, expression)
    assert len(result) == 1, (expression.source, result)
    return float(result[0]["value"][1])


def test_prometheus_loads_and_evaluates_every_shipped_rule(live: Live) -> None:
    groups = httpx.get(f"{live.prometheus_url}/api/v1/rules", timeout=5).json()["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(rules) == {expression.source.removeprefix("alert: ") for expression in
                          alert_expressions()}  # fmt: skip
    unhealthy = {name: rule.get("lastError") for name, rule in rules.items()
                 if rule["health"] != "ok"}  # fmt: skip
    assert unhealthy == {}
    # A healthy server under light load: nothing firing, nothing pending.
    alerts = httpx.get(f"{live.prometheus_url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    assert alerts == []


def test_every_alert_condition_selects_live_series(live: Live) -> None:
    """`x > 0.95` read as `x > bool 0.95` (0 or 1 per series): empty only if nothing matches.

    Catches rules that evaluate fine but can never fire: a misspelt label, or a division whose
    sides do not share their labels.
    """
    empty = {}
    for expression in alert_expressions():
        as_bool = _COMPARISON_WITH_NUMBER.sub(r"\1 bool ", expression.query)
        if not query_vector(live, Expression(expression.source, as_bool)):
            empty[expression.source] = as_bool
    assert empty == {}


def test_every_dashboard_and_alert_expression_evaluates(live: Live) -> None:
    expressions = all_expressions(RATE_INTERVAL, live.target)
    assert len(expressions) > 30  # both files were read
    failures = {}
    for expression in expressions:
        answer = query(live.prometheus_url, expression.query)
        if answer["status"] != "success" or answer.get("warnings"):
            failures[expression.source] = (expression.query, answer)
    assert failures == {}


def test_hit_rate_panel_returns_a_ratio(live: Live) -> None:
    (hit_rate,) = panel_expressions(live, "Prefix-cache hit rate")
    # Every request after the first finds the system prompt's whole blocks cached; NaN would
    # mean no prompt token was looked up in the window (0 / 0).
    assert 0.0 < single_value(live, hit_rate) <= 1.0


def test_kv_blocks_panel_returns_every_state_summing_to_the_pool(live: Live) -> None:
    (by_state,) = panel_expressions(live, "KV blocks by state")
    result = query_vector(live, by_state)
    blocks = {sample["metric"]["state"]: float(sample["value"][1]) for sample in result}
    assert set(blocks) == BLOCK_STATES
    total = Expression("pool", f'sum(kvshare_kv_blocks_total{{instance="{live.target}"}})')
    assert sum(blocks.values()) == single_value(live, total) > 0


@pytest.mark.parametrize("title", ["Time to first token", "Request latency"])
def test_latency_panels_return_p50_and_p99(live: Live, title: str) -> None:
    p50, p99 = panel_expressions(live, title)
    p50_s, p99_s = single_value(live, p50), single_value(live, p99)
    assert math.isfinite(p99_s)  # +Inf would mean a sample beyond the largest bucket
    assert 0.0 < p50_s <= p99_s


def test_every_metric_the_deploy_files_use_is_exported_and_scraped(live: Live) -> None:
    used = set().union(*(metric_names(e.query) for e in all_expressions(RATE_INTERVAL)))
    exported = {sample.partition("{")[0] for sample in scrape(live.server_url)}
    # metric_names maps _bucket/_sum/_count to the histogram; its samples end in _bucket.
    missing = {name for name in used if name not in exported and f"{name}_bucket" not in exported}
    assert missing == set()
    answer = query(live.prometheus_url, 'count by (__name__) ({__name__=~"kvshare_.+"})')
    stored = {sample["metric"]["__name__"] for sample in answer["data"]["result"]}
    assert {name for name in used if name not in stored and f"{name}_bucket" not in stored} == set()
