"""The engine's Prometheus metrics, read from its latest EngineStats snapshot at scrape time.

This module and app/metrics.py (the server's own metrics and the registry) are the only places
Prometheus metrics are defined. The snapshot's counters and gauges are cumulative, so they are
exposed as they are: no delta bookkeeping, no call into the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.config import KV_TIERS
from engine.core.protocol import CACHE_MISS_REASONS, EngineStats

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
    ("kvshare_lookahead_steps",
     "Decode steps scheduled while the step before them ran (async scheduling).",
     "num_lookahead_steps"),
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
    ("kvshare_cache_restore_audits",
     "Audits of hits that loaded blocks from the second KV tier (counted in "
     "kvshare_cache_audits_total too).", "num_restore_audits"),
    ("kvshare_cache_restore_audit_corruptions",
     "Restore audits that found corruption (counted in kvshare_cache_audit_mismatches_total "
     "too); the block, what follows it and their tier entries were dropped.",
     "num_restore_audit_corruptions"),
    ("kvshare_kv_tier_stored_blocks",
     "Second KV tier: blocks written to it (evicted from the prefix cache, or the pool's cached "
     "blocks at a graceful stop).", "num_tier_stored_blocks"),
    ("kvshare_kv_tier_loaded_blocks", "Second KV tier: blocks loaded back into the pool, verified.",
     "num_tier_loaded_blocks"),
    ("kvshare_kv_tier_checksum_failures",
     "Second KV tier: entries whose bytes failed verification on load (checksum, truncation, "
     "unreadable head); dropped, their tokens recomputed.", "num_tier_checksum_failures"),
    ("kvshare_kv_tier_refused_entries",
     "Second KV tier: valid entries refused on load (another fingerprint, namespace or token "
     "path than the lookup's); dropped, their tokens recomputed.", "num_tier_refused_entries"),
    ("kvshare_kv_tier_missing_entries",
     "Second KV tier: indexed entries gone from the store when loaded.",
     "num_tier_missing_entries"),
    ("kvshare_kv_tier_dropped_entries",
     "Second KV tier: entries dropped for room (kv_tier_max_bytes, or a namespace's cap).",
     "num_tier_dropped_entries"),
    ("kvshare_kv_tier_spills_lost",
     "Second KV tier: evicted blocks never written to it (their step failed).",
     "num_tier_spills_lost"),
    ("kvshare_kv_tier_invalidated_entries",
     "Second KV tier: entries dropped with a quarantined block (it, and what follows it).",
     "num_tier_invalidated_entries"),
    ("kvshare_kv_tier_write_errors",
     "Second KV tier: entries the store could not write (e.g. a full disk); never served.",
     "num_tier_write_errors"),
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
    ("kvshare_kv_tier_restored_entries",
     "Second KV tier: entries a previous process left that this one indexed at start.",
     "num_tier_restored_at_start"),
    ("kvshare_kv_tier_ignored_entries",
     "Second KV tier: entries found at start and removed (another fingerprint, unreadable).",
     "num_tier_ignored_at_start"),
)  # fmt: skip
# The tiers a second KV tier can be (kv_tier); "pool" is the first, the paged KV pool.
_SECOND_TIERS = tuple(tier for tier in KV_TIERS if tier != "off")
_BLOCK_STATES = (
    ("free", "num_free_blocks"),
    ("private", "num_private_blocks"),
    ("shared", "num_shared_blocks"),
    ("cached", "num_cached_blocks"),
)


class SnapshotCollector(Collector):
    """Exposes the latest EngineStats and the app's finish counts as they are at scrape time.

    `snapshot` returns both (ServerMetrics.snapshot); it is called once per scrape.
    """

    def __init__(self, snapshot: Callable[[], tuple[EngineStats, dict[str, int]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, finished = self._snapshot()
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
    yield _tier_hits(stats)
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


def _tier_hits(stats: EngineStats) -> CounterMetricFamily:
    hits = CounterMetricFamily(
        "kvshare_prefix_cache_tier_hits",
        "Prompt tokens served from the prefix cache, by the tier they came from: pool (the KV "
        "pool) or the second KV tier (disk, host; only when one is on). They sum to "
        "kvshare_prefix_cache_hits_total.",
        labels=["tier"],
    )
    hits.add_metric(["pool"], stats.prefix_cache_hits - stats.prefix_cache_tier_hits)
    if stats.kv_tier:
        hits.add_metric([stats.kv_tier], stats.prefix_cache_tier_hits)
    return hits


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
    yield from _tier_gauges(stats)
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


def _tier_gauges(stats: EngineStats) -> Iterator[Metric]:
    """Every tier kind has its series, at 0 unless it is the configured tier, so a dashboard
    or an alert selects the same series whether or not a tier is on."""
    size = GaugeMetricFamily(
        "kvshare_kv_tier_bytes",
        "Bytes of the second KV tier's entries (bounded by kv_tier_max_bytes), by tier.",
        labels=["tier"],
    )
    entries = GaugeMetricFamily(
        "kvshare_kv_tier_entries",
        "Entries (one per prefix-cache block) in the second KV tier, by tier.",
        labels=["tier"],
    )
    for tier in _SECOND_TIERS:
        is_on = tier == stats.kv_tier
        size.add_metric([tier], stats.kv_tier_bytes if is_on else 0)
        entries.add_metric([tier], stats.kv_tier_entries if is_on else 0)
    yield size
    yield entries


def _kv_usage_ratio(stats: EngineStats) -> float:
    """Blocks neither free nor evictable, over all blocks (0 before the pool exists)."""
    if not stats.num_total_blocks:
        return 0.0
    num_available = stats.num_free_blocks + stats.num_cached_blocks
    return (stats.num_total_blocks - num_available) / stats.num_total_blocks
