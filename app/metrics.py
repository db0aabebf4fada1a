"""The only place Prometheus metric objects are defined (names: docs/metrics.md;
docs/reference/metrics.md is generated from this registry by scripts/gen_docs_ref.py).

One ServerMetrics per app, on its own CollectorRegistry, so apps (and tests) never share
series. Engine numbers are pushed, not pulled: the engine publishes one immutable EngineStats
per step and observe_engine(stats) receives each exactly once on the event loop; it
histograms that step and the audits it finished, and keeps the snapshot, whose cumulative
counters and gauges a custom collector exposes as they are at scrape time (no delta
bookkeeping, no call into the engine).
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.response_store import EVICTION_REASONS
from engine.core.protocol import CACHE_MISS_REASONS, EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5)
_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_DIFF_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)

# name (without _total), help, EngineStats field
_ENGINE_COUNTERS = (
    ("kvshare_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("kvshare_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("kvshare_cache_audits", "Shadow recomputations that checked cached KV.", "num_audits"),
    ("kvshare_cache_audits_dropped", "Sampled audits dropped: queue full or engine saturated.",
     "num_audits_dropped"),
    ("kvshare_cache_quarantined_blocks",
     "KV blocks taken out of the prefix cache after a failed audit or a write violation.",
     "num_quarantined_blocks"),
    ("kvshare_cache_write_violations",
     "Slot mappings that targeted a shared or cached KV block (each failed its request).",
     "num_write_violations"),
    ("kvshare_kv_cow_copies", "Copy-on-write copies of shared KV blocks.", "num_cow_copies"),
    ("kvshare_kv_evictions", "KV blocks evicted from the prefix cache.", "num_evictions"),
    ("kvshare_kv_events_published", "KV cache events sent to subscribers (ZMQ, opt-in).",
     "num_kv_events_published"),
    ("kvshare_kv_events_dropped", "KV cache events dropped: the publisher's queue was full.",
     "num_kv_events_dropped"),
    ("kvshare_grammar_cache_hits",
     "Structured-output requests whose grammar was compiled already (or was being compiled).",
     "num_grammar_cache_hits"),
    ("kvshare_grammar_compile_failures",
     "Grammars that failed to compile or timed out (each a 400 for its request).",
     "num_grammar_compile_failures"),
    ("kvshare_preemptions", "Sequences preempted to free KV blocks.", "num_preemptions"),
    ("kvshare_prompt_tokens", "Prompt tokens of admitted requests.", "num_prompt_tokens"),
    ("kvshare_prefill_tokens", "Prompt tokens actually computed (not served from cache).",
     "num_prefill_tokens"),
    ("kvshare_generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("kvshare_spec_draft_tokens",
     "Speculative decoding: draft tokens (n-gram prompt lookup) verified by the model.",
     "num_spec_draft_tokens"),
    ("kvshare_spec_accepted_tokens",
     "Speculative decoding: draft tokens kept (the model chose the same token).",
     "num_spec_accepted_tokens"),
)  # fmt: skip
_ENGINE_GAUGES = (
    ("kvshare_kv_blocks_total", "KV blocks in the pool.", "num_total_blocks"),
    ("kvshare_kv_usage_watermark",
     "Peak fraction of KV blocks held by requests since start (cache-only blocks excluded).",
     "kv_usage_watermark"),
    ("kvshare_kv_fragmentation_ratio", "Unused token slots in allocated blocks / allocated slots.",
     "kv_fragmentation_ratio"),
    ("kvshare_kv_blocks_leaked", "Blocks the accounting cannot attribute (must stay 0).",
     "num_leaked_blocks"),
    ("kvshare_fair_share_counter_spread",
     "Fair share: largest minus least weighted service among the tenants the scheduler tracks.",
     "fair_share_counter_spread"),
)  # fmt: skip
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
_BLOCK_STATES = (
    ("free", "num_free_blocks"),
    ("private", "num_private_blocks"),
    ("shared", "num_shared_blocks"),
    ("cached", "num_cached_blocks"),
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
        self.registry.register(_SnapshotCollector(self))

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
        """A newly published snapshot: histogram its step and audits, keep the rest."""
        if stats.step is not None:
            self.step_duration.observe(stats.step.duration_s)
            self.batch_size.observe(stats.step.num_seqs)
            if stats.grammar_mask_seconds > 0:
                self.grammar_mask.observe(stats.grammar_mask_seconds)
        for diff in stats.audit_max_abs_diffs:
            self.audit_max_abs_diff.observe(diff)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
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
    """The registry as a tenant may read it: no per-tenant series (kvshare_tenant_*), and
    misses whose prompt another namespace holds counted as no_earlier_prefix (the series stays,
    at 0), so no figure says what another tenant has cached. Aggregates stay (totals, pool
    usage): they tell that others are busy, not what they sent."""

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


class _SnapshotCollector(Collector):
    """Exposes the last EngineStats and the app's finish counts as they are."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, finished = self._metrics.snapshot()
        yield from _engine_counters(stats)
        yield from _engine_gauges(stats)
        requests = CounterMetricFamily(
            "kvshare_requests",
            "Requests ended, by finish reason (stop, length, abort, error).",
            labels=["finish_reason"],
        )
        for reason, count in finished.items():
            requests.add_metric([reason], count)
        yield requests


def _engine_counters(stats: EngineStats) -> Iterator[Metric]:
    for name, doc, field in _ENGINE_COUNTERS:
        yield CounterMetricFamily(name, doc, value=getattr(stats, field))
    misses = CounterMetricFamily(
        "kvshare_prefix_cache_miss_tokens",
        "Prompt tokens not served from the prefix cache, by the reason of their request's miss "
        "(docs/cache-diagnostics.md); they sum to prompt tokens minus cached tokens.",
        labels=["reason"],
    )
    by_reason = dict.fromkeys(CACHE_MISS_REASONS, 0) | dict(stats.prefix_cache_miss_tokens)
    for reason, num_tokens in by_reason.items():
        misses.add_metric([reason], num_tokens)
    yield misses
    yield _by_kind(
        "kvshare_cache_audit_mismatches",
        "Audits whose recomputed KV differed: corruption (wrong data) or drift (numerics).",
        {"corruption": stats.num_audit_corruptions, "drift": stats.num_audit_drifts},
    )
    yield _by_kind(
        "kvshare_structured_requests",
        "Requests whose output a grammar constrains, by response_format kind.",
        {
            "json_object": stats.num_structured_json_object_requests,
            "json_schema": stats.num_structured_json_schema_requests,
            "tool_calls": stats.num_structured_tool_calls_requests,
        },
    )


def _by_kind(name: str, doc: str, values: dict[str, int]) -> CounterMetricFamily:
    counter = CounterMetricFamily(name, doc, labels=["kind"])
    for kind, value in values.items():
        counter.add_metric([kind], value)
    return counter


def _engine_gauges(stats: EngineStats) -> Iterator[Metric]:
    for name, doc, field in _ENGINE_GAUGES:
        yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
    blocks = GaugeMetricFamily("kvshare_kv_blocks", "KV blocks by state.", labels=["state"])
    memory = GaugeMetricFamily(
        "kvshare_kv_memory_bytes", "KV cache bytes by block state.", labels=["state"]
    )
    for state, field in _BLOCK_STATES:
        num_blocks = getattr(stats, field)
        blocks.add_metric([state], num_blocks)
        memory.add_metric([state], num_blocks * stats.bytes_per_block)
    yield blocks
    yield memory
    requests = GaugeMetricFamily(
        "kvshare_requests", "Requests in the engine, by state.", labels=["state"]
    )
    requests.add_metric(["running"], stats.num_running)
    requests.add_metric(["waiting"], stats.num_waiting)
    yield requests
    yield from _router_gauges(stats)
    yield GaugeMetricFamily(
        "kvshare_spec_acceptance_ratio",
        "Speculative draft tokens kept / verified since start (0 before any draft); for a "
        "window, divide the rate()s of kvshare_spec_accepted_tokens_total and _draft_tokens_total.",
        value=stats.num_spec_accepted_tokens / max(1, stats.num_spec_draft_tokens),
    )


def _router_gauges(stats: EngineStats) -> Iterator[Metric]:
    """What an endpoint picker reads besides the queue (kvshare_requests{state="waiting"}):
    the usage it balances on and the cache geometry its prefix scorer sizes itself by."""
    yield GaugeMetricFamily(
        "kvshare_kv_usage_ratio",
        "Fraction of KV blocks held by requests now, 0 to 1 (the meaning of "
        "vllm:kv_cache_usage_perc). Blocks only the prefix cache holds count as free: they are "
        "evicted on demand.",
        value=_kv_usage_ratio(stats),
    )
    info = GaugeMetricFamily(
        "kvshare_cache_config_info",
        "KV cache geometry in labels, value 1 (vllm:cache_config_info's label names): "
        "block_size in tokens, num_gpu_blocks = blocks in the pool (on whatever device).",
        labels=["block_size", "num_gpu_blocks"],
    )
    if stats.num_total_blocks:  # before the pool exists: no sample rather than 0 blocks
        info.add_metric([str(stats.block_size), str(stats.num_total_blocks)], 1)
    yield info


def _kv_usage_ratio(stats: EngineStats) -> float:
    """Blocks neither free nor evictable, over all blocks (0 before the pool exists)."""
    if not stats.num_total_blocks:
        return 0.0
    num_available = stats.num_free_blocks + stats.num_cached_blocks
    return (stats.num_total_blocks - num_available) / stats.num_total_blocks
