"""The server's own Prometheus metrics: ServerMetrics (its registry, histograms, tenant and
store series, render) and TenantLabels.

This module and app/engine_metrics.py (the engine's snapshot, read at scrape time) are the only
places Prometheus metrics are defined; names: docs/metrics.md (docs/reference/metrics.md is
generated from this registry by scripts/gen_docs_ref.py). One ServerMetrics per app, on its own
CollectorRegistry, so apps (and tests) never share series.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import Metric

from app.engine_metrics import SnapshotCollector
from app.responses.store import EVICTION_REASONS
from engine.core.protocol import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5)
_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_DIFF_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
# One block from the host or the page cache takes well under a millisecond; a long prompt's
# run of blocks from disk tens of milliseconds.
_TIER_LOAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

_SEGMENT_LABELS = (
    "system",
    "tools",
    "user",
    "assistant",
    "tool",
    "message",
    "generation_prompt",
    "prompt",
)


DEFAULT_TENANT_LABEL = "default"  # the one tenant without API keys
OTHER_TENANT_LABEL = "other"  # every tenant past max_tenant_labels


class TenantLabels:
    """A tenant's metric label: a short hash of its id (never the id), at most max_labels
    distinct ones (the first seen keep theirs); the rest share OTHER_TENANT_LABEL."""

    def __init__(self, max_labels: int) -> None:
        self.max_labels = max_labels
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()

    def of(self, tenant: str | None) -> str:
        if tenant is None:
            return DEFAULT_TENANT_LABEL
        with self._lock:
            label = self._labels.get(tenant)
            if label is None and len(self._labels) < self.max_labels:
                label = hashlib.sha256(tenant.encode()).hexdigest()[:8]
                self._labels[tenant] = label
        return label or OTHER_TENANT_LABEL


class ServerMetrics:
    """Per-app metrics. Observation methods are cheap and safe from any thread."""

    def __init__(self, max_tenant_labels: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_labels = TenantLabels(max_tenant_labels)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._finished = dict.fromkeys(FINISH_REASONS, 0)
        self._define_histograms()
        self.registry.register(SnapshotCollector(self.snapshot))

    def _define_histograms(self) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.time_to_first_token = histogram(
            "kvshare_time_to_first_token_seconds",
            "Seconds from request arrival to its first generated token.",
            _LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "kvshare_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request.",
            _TOKEN_GAP_BUCKETS,
        )
        self.request_duration = histogram(
            "kvshare_request_duration_seconds",
            "Seconds from request arrival to its end (any finish reason).",
            _DURATION_BUCKETS,
        )
        self.step_duration = histogram(
            "kvshare_step_duration_seconds", "Seconds per engine step.", _TOKEN_GAP_BUCKETS
        )
        self.batch_size = histogram(
            "kvshare_batch_size", "Sequences per engine step.", _BATCH_BUCKETS
        )
        self.chat_template_append_only = Gauge(
            "kvshare_chat_template_append_only",
            "1 when the chat template renders each turn as an extension of the previous one "
            "(checked at start); 0: it rewrites history and multi-turn chats miss the cache.",
            registry=self.registry,
        )
        self.cache_divergence = self._counter_at_zero(
            "kvshare_prefix_cache_divergence",
            "Diagnosed requests (cache_diagnostics) by the segment of their first prompt token "
            "not served from the prefix cache: system, tools, a message role, generation_prompt, "
            "prompt.",
            "segment",
            _SEGMENT_LABELS,
        )
        self.grammar_compile = histogram(
            "kvshare_grammar_compile_seconds",
            "Seconds to compile a structured-output grammar (cache misses only).",
            _LATENCY_BUCKETS,
        )
        self.grammar_mask = histogram(
            "kvshare_grammar_mask_seconds",
            "Seconds the grammar masks added to an engine step (steps with constrained rows).",
            _TOKEN_GAP_BUCKETS,
        )
        self._define_tenant_metrics()
        self._define_store_metrics()
        self.audit_max_abs_diff = histogram(
            "kvshare_cache_audit_max_abs_diff",
            "Largest |cached - recomputed| difference (reused K/V or last-prompt logits) "
            "per cache audit.",
            _DIFF_BUCKETS,
        )
        self.tier_load = histogram(
            "kvshare_kv_tier_load_seconds",
            "Seconds per load from the second KV tier: one admission's run of consecutive "
            "blocks, read and verified.",
            _TIER_LOAD_BUCKETS,
        )

    def _define_tenant_metrics(self) -> None:
        tenant = ["tenant"]
        self.tenant_queue_time = Histogram(
            "kvshare_tenant_queue_time_seconds",
            "Seconds from a request's arrival to its first output, by tenant.",
            tenant,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tenant_prompt_tokens = Counter(
            "kvshare_tenant_prompt_tokens",
            "Prompt tokens of ended requests, by tenant.",
            tenant,
            registry=self.registry,
        )
        self.tenant_generation_tokens = Counter(
            "kvshare_tenant_generation_tokens",
            "Tokens generated for ended requests, by tenant.",
            tenant,
            registry=self.registry,
        )
        self.tenant_rejections = Counter(
            "kvshare_tenant_rejections",
            "Requests refused with a 429 by a per-tenant limit, by tenant and reason "
            "(running, waiting, prompt_tokens).",
            ["tenant", "reason"],
            registry=self.registry,
        )
        for reason in ("running", "waiting", "prompt_tokens"):  # at 0 until the first 429
            self.tenant_rejections.labels(DEFAULT_TENANT_LABEL, reason)

    def _define_store_metrics(self) -> None:
        self.stored_responses = Gauge(
            "kvshare_stored_responses",
            "Responses in the response store (store: true), every tenant's.",
            registry=self.registry,
        )
        self.response_store_bytes = Gauge(
            "kvshare_response_store_bytes",
            "Bytes of the stored responses (their JSON bodies), bounded by store_max_bytes.",
            registry=self.registry,
        )
        self.response_store_evictions = self._counter_at_zero(
            "kvshare_response_store_evictions",
            "Stored responses evicted, by reason: ttl (older than store_ttl_seconds), count "
            "(over store_max_responses), bytes (over store_max_bytes).",
            "reason",
            EVICTION_REASONS,
        )

    def _counter_at_zero(self, name: str, doc: str, label: str, values) -> Counter:
        """A counter with one label, each of `values` exported at 0 from the start: alerts and
        dashboards take rate() of them, which needs a series before the first event."""
        counter = Counter(name, doc, [label], registry=self.registry)
        for value in values:
            counter.labels(value)
        return counter

    # -- observed by the app ----------------------------------------------------------------

    def observe_response_store(
        self, num_responses: int, num_bytes: int, evictions: dict[str, int]
    ) -> None:
        """The response store's size after a change, and what that change evicted."""
        self.stored_responses.set(num_responses)
        self.response_store_bytes.set(num_bytes)
        for reason, num_evicted in evictions.items():
            if num_evicted:
                self.response_store_evictions.labels(reason).inc(num_evicted)

    def observe_cache_divergence(self, segment: dict | None) -> None:
        """A diagnosed request's first unmatched token fell in `segment` (None: full hit)."""
        if segment is None:
            return
        name = segment.get("role") if segment["kind"] == "message" else segment["kind"]
        self.cache_divergence.labels(name if name in _SEGMENT_LABELS else "message").inc()

    def observe_tenant_queue_time(self, tenant: str | None, seconds: float) -> None:
        self.tenant_queue_time.labels(self.tenant_labels.of(tenant)).observe(seconds)

    def observe_tenant_tokens(
        self, tenant: str | None, num_prompt_tokens: int, num_generated_tokens: int
    ) -> None:
        label = self.tenant_labels.of(tenant)
        self.tenant_prompt_tokens.labels(label).inc(num_prompt_tokens)
        self.tenant_generation_tokens.labels(label).inc(num_generated_tokens)

    def observe_tenant_rejection(self, tenant: str | None, reason: str) -> None:
        self.tenant_rejections.labels(self.tenant_labels.of(tenant), reason).inc()

    def observe_request(self, finish_reason: str, duration_s: float) -> None:
        """One request ended: stop | length (any choice cut by max_tokens) | abort | error."""
        with self._lock:
            self._finished[finish_reason] = self._finished.get(finish_reason, 0) + 1
        self.request_duration.observe(duration_s)

    # -- pushed by the engine, once per step ----------------------------------------------------

    def observe_engine(self, stats: EngineStats) -> None:
        """A newly published snapshot, each exactly once, on the event loop: histogram its
        step, audits, compiles and tier loads; keep the rest for the scrape
        (app/engine_metrics.py)."""
        if stats.step is not None:
            self.step_duration.observe(stats.step.duration_s)
            self.batch_size.observe(stats.step.num_seqs)
            if stats.grammar_mask_seconds > 0:
                self.grammar_mask.observe(stats.grammar_mask_seconds)
        for diff in stats.audit_max_abs_diffs:
            self.audit_max_abs_diff.observe(diff)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
        for seconds in stats.tier_load_seconds:
            self.tier_load.observe(seconds)
        with self._lock:
            self._stats = stats

    def render(self, tenant_view: bool = False) -> bytes:
        """The Prometheus text exposition of everything in this registry; tenant_view: what a
        tenant may read (_TenantView)."""
        return generate_latest(_TenantView(self.registry) if tenant_view else self.registry)

    def snapshot(self) -> tuple[EngineStats, dict[str, int]]:
        with self._lock:
            return self._stats, dict(self._finished)


class _TenantView:
    """The registry as a tenant may read it: no kvshare_tenant_* series, and no figure that
    says what another tenant has cached (other_namespace misses count as no_earlier_prefix).
    Aggregates stay: they tell that others are busy, not what they sent."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            if metric.name.startswith("kvshare_tenant_"):
                continue
            if metric.name == "kvshare_prefix_cache_miss_tokens":
                metric.samples = _folded(metric.samples, "other_namespace", "no_earlier_prefix")
            yield metric


def _folded(samples: list, reason: str, into: str) -> list:
    moved = sum(s.value for s in samples if s.labels.get("reason") == reason)
    folded = []
    for sample in samples:
        if sample.labels.get("reason") == reason:
            sample = sample._replace(value=0.0)
        elif sample.labels.get("reason") == into:
            sample = sample._replace(value=sample.value + moved)
        folded.append(sample)
    return folded
