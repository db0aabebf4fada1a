"""The second KV tier of a model runner: its store, its fingerprint, its restart, its save at a
graceful stop and its figures in the engine's stats.

The fingerprint names everything the KV of a block depends on besides its tokens and namespace:
the weights (their version), the tokenizer (its files' digest), the block size, the pool's
dtype and per-block layout, and the compute mode (dtype, quantization, attention backend, the
CPU kernel path). Entries written under another fingerprint are never served
(engine/kv/kv_tier.py).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from engine.audit.auditor import AuditCounters
from engine.core.config import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_tier import KVTier
from engine.kv.tier_format import engine_fingerprint, entry_size_bound
from engine.kv.tier_store import FileTierStore, MemoryTierStore
from engine.runtime.block_io import read_blocks
from engine.runtime.cpu.capabilities import cpu_capabilities
from engine.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)
_SAVE_CHUNK_BLOCKS = 64  # blocks read out of the pool at a time at a graceful stop


def tier_directory(config: EngineConfig) -> Path:
    return (
        Path(config.kv_tier_dir).expanduser()
        if config.kv_tier_dir
        else (config.cache_root() / "kv-tier")
    )


def runner_fingerprint(config: EngineConfig, runner: ModelRunner) -> str:
    fields = {
        "weights": runner.model_info.weights_version,
        "tokenizer": tokenizer_digest(runner.model_info.tokenizer_path),
        "block_size": runner.block_size,
        "kv_dtype": str(runner.kv_dtype),
        "kv_layout": [[list(cache.shape[1:]) for cache in pair] for pair in runner.kv_caches],
        "dtype": str(runner.dtype),
        "quantization": config.quantization,
        "attention": runner.attn_backend.name,
        "device": runner.device.type,
        "cpu": repr(cpu_capabilities()) if runner.device.type == "cpu" else "",
    }
    return engine_fingerprint(fields)


def tokenizer_digest(tokenizer_path: str) -> str:
    digest = hashlib.sha256()
    directory = Path(tokenizer_path)
    for name in _TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_kv_tier(config: EngineConfig, runner: ModelRunner) -> KVTier | None:
    """The configured tier (None when off or without the prefix cache), restored from its
    directory when it is on disk and warm restart is on."""
    if config.kv_tier == "off":
        return None
    if not config.enable_prefix_cache:
        logger.warning("kv_tier is %s but the prefix cache is off: no tier", config.kv_tier)
        return None
    disk = config.kv_tier == "disk"
    store = FileTierStore(tier_directory(config)) if disk else MemoryTierStore()
    tier = KVTier(
        store,
        runner_fingerprint(config, runner),
        runner.block_size,
        config.kv_tier_max_bytes,
        config.max_cached_blocks_per_namespace,
        read_ahead=True,
    )
    if store.persistent and config.kv_tier_warm_restart:
        tier.restore()
    elif store.persistent:
        tier.clear_store()
    return tier


def save_cached_blocks(kv: KVCacheManager, runner: ModelRunner, tier: KVTier | None) -> int:
    """Write the prefix tree's blocks the tier lacks into it (least recently used first, so
    the cap keeps the recent ones) and wait for the store; returns how many."""
    if tier is None:
        return 0
    spills = kv.unsaved_cached_blocks()  # least recently used first, ancestors after
    budget, num_kept = tier.max_bytes, 0
    for spill in reversed(spills):  # the most recently used that fit (older entries make way)
        budget -= entry_size_bound(len(spill.token_ids), runner.bytes_per_block)
        if budget < 0:
            break
        num_kept += 1
    spills = spills[len(spills) - num_kept :]
    tier.set_pool_counter(lambda _namespace: 0)  # the pool is going: only the tier counts
    for start in range(0, len(spills), _SAVE_CHUNK_BLOCKS):
        chunk = spills[start : start + _SAVE_CHUNK_BLOCKS]
        kv.store_spilled(chunk, read_blocks(runner.kv_caches, [spill.block_id for spill in chunk]))
    tier.flush()
    logger.info("KV tier: saved %d cached blocks", len(spills))
    return len(spills)


def tier_figures(tier: KVTier | None, kv: KVCacheManager, audits: AuditCounters) -> dict[str, Any]:
    """The EngineStats fields of the tier and of the audits of restored KV."""
    figures: dict[str, Any] = {
        "num_restore_audits": audits.num_restore_audits,
        "num_restore_audit_corruptions": audits.num_restore_corruptions,
    }
    if tier is None:
        return figures
    counters = tier.counters
    link = kv.tier_link
    return figures | {
        "kv_tier": tier.kind,
        "kv_tier_bytes": tier.num_bytes,
        "kv_tier_entries": tier.num_entries,
        "num_tier_stored_blocks": counters.num_stored,
        "num_tier_loaded_blocks": counters.num_loaded_blocks,
        "num_tier_checksum_failures": counters.num_checksum_failures,
        "num_tier_refused_entries": counters.num_refused,
        "num_tier_missing_entries": counters.num_missing,
        "num_tier_dropped_entries": counters.num_dropped,
        "num_tier_restored_at_start": counters.num_restored_at_start,
        "num_tier_ignored_at_start": counters.num_ignored_at_start,
        "num_tier_spills_lost": link.num_spills_lost if link is not None else 0,
        "num_tier_invalidated_entries": counters.num_invalidated,
        "num_tier_write_errors": tier.store.num_write_errors,
        "tier_load_seconds": tuple(counters.drain_load_seconds()),
    }
