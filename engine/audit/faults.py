"""Fault drills: damage the prefix cache's KV on purpose, so the auditor can be seen to catch it.

Refused unless the engine runs with enable_fault_injection (LLMEngine checks; POST
/debug/faults). Drills touch only the KV tensors, through the KV cache manager's public view
of what is cached, so no production class carries drill code:
  corrupt_block  overwrites one cached block's K and V, in every layer, with noise of the
                 block's own magnitude (far beyond any audit tolerance);
  wrong_block    exchanges the K and V of two cached blocks: each one's tokens now map to
                 the other's KV, so a prefix reads KV of other tokens.
References, ownership and the tree stay consistent: only the data is wrong. The tier_* kinds
damage the second KV tier's entries instead (engine/audit/tier_faults.py).
"""

from __future__ import annotations

import torch

from engine.audit.tier_faults import TIER_FAULT_KINDS, inject_tier_fault
from engine.core.errors import InvalidFaultTarget, UnknownFaultKind
from engine.core.protocol import FAULT_KINDS, FaultReport
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_tier import KVTier

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, bs, Hkv, D] each


class FaultInjector:
    """Applies drills to the KV of one engine (between steps, on the engine thread)."""

    def __init__(self, kv: KVCacheManager, kv_caches: KVCaches, tier: KVTier | None = None) -> None:
        self.kv = kv
        self.kv_caches = kv_caches
        self.tier = tier  # the second KV tier's drills (engine/audit/tier_faults.py)
        self._num_faults = 0  # seeds the noise: drills are reproducible

    def inject(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        """Targets default to the first block of the most recently used cached path;
        wrong_block's other block defaults to a cached block off that path."""
        if kind not in FAULT_KINDS:
            raise UnknownFaultKind(kind, FAULT_KINDS)
        if kind in TIER_FAULT_KINDS:
            return inject_tier_fault(self.tier, kind)
        if not self.kv.is_prefix_caching:
            raise InvalidFaultTarget("the prefix cache is off: no cached block to damage")
        path, cached = self.kv.recent_cached_path(), set(self.kv.cached_block_ids())
        target = block_id if block_id is not None else next(iter(path), None)
        if target is None or target not in cached:
            raise InvalidFaultTarget(f"block {target} is not in the prefix cache")
        if kind == "corrupt_block":
            generator = torch.Generator().manual_seed(self._num_faults)
            self._num_faults += 1
            corrupt_block(self.kv_caches, target, generator)
            return FaultReport(kind, [target], f"overwrote the K/V of cached block {target}")
        other = other_block_id
        if other is None:
            off_path = sorted(cached - set(path))
            other = off_path[0] if off_path else next((b for b in path if b != target), None)
        if other is None or other == target or other not in cached:
            raise InvalidFaultTarget(
                f"wrong_block needs another cached block than {target}, got {other}"
            )
        swap_blocks(self.kv_caches, target, other)
        detail = f"cached blocks {target} and {other} now hold each other's K/V"
        return FaultReport(kind, [target, other], detail)


def corrupt_block(kv_caches: KVCaches, block_id: int, generator: torch.Generator) -> None:
    """Overwrite block_id's K and V in every layer, in place, with noise of its magnitude."""
    with torch.inference_mode():
        for k_cache, v_cache in kv_caches:
            for cache in (k_cache, v_cache):
                block = cache[block_id]  # [block_size, Hkv, D], a view
                scale = max(1.0, float(block.abs().max()))
                noise = torch.randn(block.shape, generator=generator, dtype=torch.float32)
                block.copy_(noise.mul_(scale).to(block.device, block.dtype))


def swap_blocks(kv_caches: KVCaches, block_a: int, block_b: int) -> None:
    """Exchange the K and V of two blocks in every layer, in place."""
    with torch.inference_mode():
        for k_cache, v_cache in kv_caches:
            for cache in (k_cache, v_cache):
                pair = cache[[block_a, block_b]].clone()  # [2, block_size, Hkv, D]
                cache[[block_b, block_a]] = pair
