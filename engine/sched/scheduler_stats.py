"""What the scheduler counts, and the EngineStats snapshot built from it (torch-free).

The counters are monotonic and kept up to date as the scheduler works; the snapshot reads them
and the KV facade's O(1) figures, so building it never walks the pool or the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.protocol import EngineStats
from engine.kv.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerCounters:
    """Monotonic counters for EngineStats."""

    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of added requests
    num_prefill_tokens: int = 0  # tokens computed in prefill chunks, recomputation included
    num_generation_tokens: int = 0  # sampled tokens, every choice counted
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission (cache on)
    prefix_cache_hits: int = 0  # of those, tokens reused from the cache
    prefix_cache_tier_hits: int = 0  # of those, tokens loaded from the second tier
    num_write_violations: int = 0  # slot mappings into shared / cached blocks (requests failed)
    num_spec_draft_tokens: int = 0  # speculative draft tokens verified
    num_spec_accepted_tokens: int = 0  # of those, kept (equal to the target's own choice)
    num_lookahead_steps: int = 0  # steps scheduled while the one before ran (lookahead.py)


def engine_stats(
    counters: SchedulerCounters,
    kv: KVCacheManager,
    num_running: int,
    num_waiting: int,
    num_leaked_blocks: int,
    **fields: Any,
) -> EngineStats:
    """The scheduler's share of EngineStats, with `fields` (those it does not own) set in the
    same construction; the rest stay default."""
    usage = kv.usage
    return EngineStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_total_blocks=usage.num_total_blocks,
        num_free_blocks=usage.num_free_blocks,
        num_private_blocks=usage.num_private_blocks,
        num_shared_blocks=usage.num_shared_blocks,
        num_cached_blocks=usage.num_cached_blocks,
        block_size=kv.block_size,
        kv_usage_watermark=usage.usage_watermark,
        kv_fragmentation_ratio=usage.fragmentation_ratio,
        num_preemptions=counters.num_preemptions,
        num_prompt_tokens=counters.num_prompt_tokens,
        num_prefill_tokens=counters.num_prefill_tokens,
        num_generation_tokens=counters.num_generation_tokens,
        num_cow_copies=kv.num_cow_copies,
        num_evictions=kv.num_evictions,
        prefix_cache_queries=counters.prefix_cache_queries,
        prefix_cache_hits=counters.prefix_cache_hits,
        prefix_cache_tier_hits=counters.prefix_cache_tier_hits,
        prefix_cache_miss_tokens=tuple(sorted(kv.miss_tokens_by_reason.items())),
        num_quarantined_blocks=kv.num_quarantined_blocks,
        num_write_violations=counters.num_write_violations,
        num_spec_draft_tokens=counters.num_spec_draft_tokens,
        num_spec_accepted_tokens=counters.num_spec_accepted_tokens,
        num_lookahead_steps=counters.num_lookahead_steps,
        num_leaked_blocks=num_leaked_blocks,
        **fields,
    )
