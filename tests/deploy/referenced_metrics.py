"""The kvshare metrics that files outside the code name, each with where it was named.

Read from the endpoint picker's config and its legacy flags (deploy/k8s/gateway/), the Grafana
dashboard and the docs' metric sections (docs/metrics.md, docs/deployment.md).
tests/app/test_metrics.py scrapes the app and asserts every one is exported;
tests/deploy/test_gateway.py checks the picker's specs by shape.

    for ref in referenced_metrics():
        ...  # ref.name: a family as its TYPE line names it; ref.labels: pairs a sample must carry
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.deploy.promql import dashboard_expressions, metric_names

REPO_ROOT = Path(__file__).resolve().parents[2]
GATEWAY_DIR = REPO_ROOT / "deploy" / "k8s" / "gateway"
METRICS_PAGE = REPO_ROOT / "docs" / "metrics.md"
DEPLOYMENT_PAGE = REPO_ROOT / "docs" / "deployment.md"
PICKER_ENGINE = "kvshare"  # the engineConfigs entry that describes kvshare pods

# PromQL instant-vector selector, as the picker parses a spec: name{label="value",...}.
_SELECTOR = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?$")
_LABEL = re.compile(r'^\s*(\w+)\s*=(?![~=])\s*"?([^",~]*)"?\s*$')
_LEGACY_FLAG = re.compile(r"^--[\w-]+-metric=(.*)$", re.MULTILINE)
_SPEC_KEYS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
              "cacheInfoSpec")  # fmt: skip


@dataclass(frozen=True)
class MetricRef:
    source: str
    name: str
    labels: tuple[tuple[str, str], ...] = ()  # exact-match label pairs


def parse_selector(spec: str, source: str) -> MetricRef:
    """`name` or `name{a="x",b=y}` (quotes optional, as the picker allows); else ValueError."""
    match = _SELECTOR.match(spec.strip())
    if not match:
        raise ValueError(f"{source}: not a metric selector: {spec!r}")
    labels = []
    for pair in filter(None, (match["labels"] or "").split(",")):
        label = _LABEL.match(pair)
        if not label:
            raise ValueError(f"{source}: not an exact label match: {pair!r}")
        labels.append((label[1], label[2]))
    return MetricRef(source, match["name"], tuple(labels))


def picker_config() -> dict:
    """The EndpointPickerConfig inside deploy/k8s/gateway/epp-config.yaml."""
    configmap = yaml.safe_load((GATEWAY_DIR / "epp-config.yaml").read_text())
    (text,) = configmap["data"].values()
    return yaml.safe_load(text)


def picker_specs() -> dict[str, str]:
    """kvshare's engineConfigs entry: spec key -> spec ("" = disabled)."""
    (extractor,) = [p for p in picker_config()["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == PICKER_ENGINE]
    return {key: engine.get(key, "") for key in _SPEC_KEYS}


def legacy_flag_specs() -> list[str]:
    """The `--*-metric=` flags README.md gives for EPP v1.0 to v1.3 ("" = disabled)."""
    return _LEGACY_FLAG.findall((GATEWAY_DIR / "README.md").read_text())


def picker_refs() -> list[MetricRef]:
    config = [(f"epp-config.yaml {key}", spec) for key, spec in picker_specs().items()]
    flags = [("deploy/k8s/gateway/README.md flag", spec) for spec in legacy_flag_specs()]
    return [parse_selector(spec, source) for source, spec in config + flags if spec]


def dashboard_refs() -> list[MetricRef]:
    return [
        MetricRef(expression.source, name)
        for expression in dashboard_expressions()
        for name in sorted(metric_names(expression.query))
    ]


def doc_section(path: Path, title: str, text: str | None = None) -> str:
    """The body of the section of a Markdown page with this heading, up to the next heading of
    its level or above (a `#` line inside a fenced code block is a shell comment, not a heading)."""
    lines = (path.read_text() if text is None else text).splitlines(keepends=True)
    heading = re.compile(r"^(#+) (.*)$")
    body, level, in_code = [], 0, False
    for line in lines:
        in_code ^= line.startswith("```")
        match = None if in_code or line.startswith("```") else heading.match(line)
        if level and match and len(match[1]) <= level:
            break
        if level:
            body.append(line)
        elif match and match[2].strip() == title:
            level = len(match[1])
    if not level:
        raise ValueError(f"{path.name} has no section {title!r}")
    return "".join(body)


def doc_table_names(section: str) -> list[str]:
    """Backticked names in the first cell of each table row; the section says `kvshare_` once."""
    names = []
    for row in re.findall(r"^\| *([^|]+?) *\|", section, re.MULTILINE):
        for name in re.findall(r"`([a-z_]+)(?:\{[^}]*\})?`", row):
            names.append(name if name.startswith("kvshare_") else f"kvshare_{name}")
    return names


def docs_refs() -> list[MetricRef]:
    meaning = doc_section(METRICS_PAGE, "What the metrics mean")
    refs = [MetricRef("docs metrics table", name) for name in doc_table_names(meaning)]
    replicas = doc_section(DEPLOYMENT_PAGE, "More than one replica")
    for spec in re.findall(r"`(kvshare_\w+(?:\{[^}`]*\})?)`", replicas):
        refs.append(parse_selector(spec, "docs More than one replica"))
    return refs


def referenced_metrics() -> list[MetricRef]:
    return picker_refs() + dashboard_refs() + docs_refs()
