"""Every PromQL expression that kvshare's deploy files ship, ready to evaluate.

The integration test sends these to a live Prometheus (`/api/v1/query`) scraping a real
kvshare server; the deploy tests check the metric names they use. Grafana variables in the
dashboard are substituted first, since Prometheus does not know them.

    from tests.deploy.promql import all_expressions
    for expr in all_expressions(rate_interval="30s"):
        ...  # expr.source says where it came from, expr.query is plain PromQL
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "kvshare.json"
ALERTS_PATH = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_METRIC = re.compile(r"\bkvshare_\w+")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Expression:
    source: str  # "dashboard: <panel title> [refId]" or "alert: <name>"
    query: str  # plain PromQL: Grafana variables already substituted


def substitute_variables(query: str, variables: dict[str, str]) -> str:
    """Replaces $name and ${name}; an unknown variable raises KeyError (no silent leftovers)."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no value for Grafana variable ${name} in {query!r}")
        return variables[name]

    return _VARIABLE.sub(replace, query)


def _panels(panels: list[dict]) -> list[dict]:
    """Flattens rows: a collapsed row keeps its panels inside."""
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(_panels(panel.get("panels", [])))
    return flat


def dashboard_expressions(
    dashboard: dict | None = None, rate_interval: str = "1m", instance: str = ".*"
) -> list[Expression]:
    """The `expr` of every panel target, with $__rate_interval and $instance substituted."""
    if dashboard is None:
        dashboard = json.loads(DASHBOARD_PATH.read_text())
    variables = {"__rate_interval": rate_interval, "instance": instance}
    return [
        Expression(
            f"dashboard: {panel['title']} [{target['refId']}]",
            substitute_variables(target["expr"], variables),
        )
        for panel in _panels(dashboard["panels"])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def alert_expressions(rules: dict | None = None) -> list[Expression]:
    """The `expr` of every alerting and recording rule, whitespace folded to single spaces."""
    if rules is None:
        rules = yaml.safe_load(ALERTS_PATH.read_text())
    return [
        Expression(
            f"alert: {rule.get('alert') or rule.get('record')}", " ".join(rule["expr"].split())
        )
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def all_expressions(rate_interval: str = "1m", instance: str = ".*") -> list[Expression]:
    """Dashboard and alert-rule expressions, read from the checked-in files."""
    return dashboard_expressions(None, rate_interval, instance) + alert_expressions()


def metric_names(query: str) -> set[str]:
    """The kvshare_ metric families a query reads; _bucket/_sum/_count map to their histogram."""
    names = set()
    for name in _METRIC.findall(query):
        for suffix in _HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names
