"""Shadow audit of the prefix cache: recompute sampled cache hits without the cache, compare,
and quarantine what is wrong.

What is audited. A sampled fraction (audit_sample_rate; a hash of the request id, so no global
random state) of first admissions that reused cached tokens (batch.CacheHit); hits that loaded
blocks from the second tier at audit_restored_sample_rate instead (restored KV is checked more
often: DESIGN invariant 8), counted apart too. The auditor
takes a reference on the tree blocks the hit reused (they can be neither evicted nor reused
until compared), asks the runner to keep the logits row the sequence gets at its last prompt
token, and recomputes the whole prompt, in chunks, into private blocks of its own (allocated
through the KV cache manager, so the accounting stays exact; never inserted in the tree;
released afterwards). Then it compares
  - K and V of every reused block, in every layer, slot by slot (for a partially matching
    block only its matching leading slots), with the recomputed block at the same position;
  - the logits row at the last prompt position, and its argmax (the greedy token).

Classification. error = max|cached - recomputed| / max(1, max|recomputed|), per compared block
(over layers, K and V) and for the logits row: relative, because floating-point differences
grow with the magnitude of the values (absolute below 1).
  clean       every error <= the clean tolerance, min(CLEAN_ULPS * machine epsilon,
              tolerance / 10), and the same greedy token: float32 sums reordered across a
              few dozen layers stay within CLEAN_ULPS ulps; in half precision one rounding
              already reaches an ulp, so there clean means within a tenth of the tolerance;
  drift       every error <= tolerance, but not clean: numerics (the cached path computed the
              prompt in other chunks and batches, so sums ran in another order), reported but
              not pollution;
  corruption  some error > tolerance: the cache gave KV that is not the KV of these tokens.
Tolerances are per dtype (EngineConfig.audit_tolerance_*): float32 1e-3, float16 0.1, bfloat16
0.25. Measured on SmolLM2 (30 layers; a 200-token prompt cached in 32-token chunks, recomputed
in 13-token ones), normal traffic reaches float32 5e-6, float16 0.016, bfloat16 0.071, while
KV of other tokens (a wrong block) gives 1.5 and noise 4: each threshold sits between, with a
margin of 3x or more on both sides (200x and 1000x in float32).
Under quantization int8 the threshold is audit_tolerance_int8 (0.35): chunking reaches 0.17 there
(activation codes rounding the other way), wrong KV 0.71; fp16 weights keep float32's (2e-6).

On corruption the blocks whose error is beyond tolerance (all reused blocks when only the
logits are) are quarantined: KVCacheManager.quarantine() drops them from the tree with every
block cached after them, so no new request can match them, and no sequence will insert them
again; a warning names the request and the blocks. Requests already reading those blocks keep
going: their attention has used the KV already, and failing every request that shares a hot
prefix would turn a detector into an outage; the audit reports them instead.

Cost. Audit tokens run as a separate eager forward after the step, only in the budget the
step left (max_num_batched_tokens - scheduled tokens, within the fair-share prefill cap while
several tenants are active: SchedulerOutput.num_spare_tokens) and at most
audit_max_tokens_per_step; a long prompt takes several steps. Private blocks come only from
free or evictable blocks, and leave one block per running sequence. A sampled hit beyond
audit_max_pending queued audits, and an audit that could not progress for MAX_IDLE_STEPS steps
(a saturated engine), are dropped and counted (num_audits_dropped).

Fault drills that show the audit at work live in engine/audit/faults.py.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.batch import CacheHit, ScheduledSeq, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.sequence import Sequence
from engine.kv.kv_cache_manager import KVCacheManager
from engine.runtime.block_io import read_blocks
from engine.runtime.model_runner import ModelRunner
from engine.runtime.transfer import split_to_device

logger = logging.getLogger(__name__)

CLEAN_ULPS = 64  # clean: within 64 machine epsilons (capped at a tenth of the tolerance)
MAX_IDLE_STEPS = 64  # an audit that gets no tokens for this many steps is dropped
_MAX_RECENT = 10_000


class Verdict(enum.StrEnum):
    CLEAN = "clean"
    DRIFT = "drift"
    CORRUPTION = "corruption"


@dataclass(frozen=True)
class AuditResult:
    request_id: str
    verdict: Verdict
    num_cached_tokens: int
    max_abs_diff: float  # over the compared K/V slots and the logits row
    max_error: float  # the relative figure that was classified: max of the next two
    kv_error: float  # over the reused blocks' K/V
    logits_error: float | None  # None: the logits could not be compared
    greedy_token_matches: bool | None  # None: the logits could not be compared
    bad_block_ids: list[int]  # blocks beyond tolerance
    quarantined_block_ids: list[int]


@dataclass
class AuditCounters:
    num_audits: int = 0  # completed audits
    num_corruptions: int = 0
    num_drifts: int = 0
    num_dropped: int = 0
    num_restore_audits: int = 0  # of num_audits, hits that loaded blocks from the second tier
    num_restore_corruptions: int = 0


@dataclass(eq=False)
class _Audit:
    audit_id: int
    hit: CacheHit
    num_computed_tokens: int = 0
    private_block_ids: list[int] = field(default_factory=list)
    recomputed_logits: torch.Tensor | None = None  # [V]
    cached_logits: torch.Tensor | None = None  # [V]
    num_idle_steps: int = 0

    @property
    def holder(self) -> str:
        return f"audit-{self.audit_id}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.hit.prompt_token_ids)

    @property
    def is_recomputed(self) -> bool:
        return self.num_computed_tokens == self.num_prompt_tokens


def is_sampled(request_id: str, sample_rate: float) -> bool:
    """Deterministic sampling: a hash of the request id against the rate."""
    if sample_rate >= 1.0:
        return True
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < sample_rate * 2**64


def audit_tolerance(config: EngineConfig, dtype: torch.dtype) -> float:
    """The corruption threshold: per dtype, or audit_tolerance_int8 under quantization int8,
    whose activation rounding turns the chunking's fp32 differences into whole code steps.
    fp16 weights keep fp32 activations and sums: float32's threshold (measured alike)."""
    if config.quantization == "int8":
        return config.audit_tolerance_int8
    return config.audit_tolerance(str(dtype).removeprefix("torch."))


class Auditor:
    """Owned by LLMEngine, driven on the engine thread: start() with the cache hits of each
    schedule() (before the runner executes, so that their logits are captured), run() after
    the step with the token budget it left. Counters may be read from any thread."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv_cache_manager: KVCacheManager,
        get_seq: Callable[[int], Sequence | None],
    ) -> None:
        self.sample_rate = config.audit_sample_rate
        self.restored_sample_rate = config.audit_restored_sample_rate
        self.max_tokens_per_step = config.audit_max_tokens_per_step
        self.max_pending = config.audit_max_pending
        # The coarser of the model's and the KV cache's dtypes sets the bar (fp16 K/V are
        # rounded where they are stored, alike in the cached and the recomputed blocks).
        dtypes = (runner.dtype, getattr(runner, "kv_dtype", runner.dtype))
        dtype = max(dtypes, key=lambda d: torch.finfo(d).eps)
        self.tolerance = audit_tolerance(config, dtype)
        epsilon = torch.finfo(dtype).eps
        self.clean_tolerance = min(CLEAN_ULPS * epsilon, self.tolerance / 10)
        self.runner = runner
        self.kv = kv_cache_manager
        self._get_seq = get_seq
        self.counters = AuditCounters()
        self.recent_results: deque[AuditResult] = deque(maxlen=100)
        self._pending: deque[_Audit] = deque()
        self._next_audit_id = 0
        self._recent_diffs: deque[float] = deque(maxlen=_MAX_RECENT)

    # -- queue ------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self, hits: list[CacheHit]) -> None:
        """Queue an audit for each sampled hit (or count it dropped when the queue is full)."""
        for hit in hits:
            rate = self.restored_sample_rate if hit.num_restored_tokens else self.sample_rate
            if not is_sampled(hit.request_id, rate):
                continue
            audit = _Audit(self._next_audit_id, hit)
            self._next_audit_id += 1
            if len(self._pending) >= self.max_pending or not self.kv.hold_blocks(
                audit.holder, hit.cached_block_ids
            ):
                self.counters.num_dropped += 1
                continue
            self.runner.capture_prompt_logits(hit.seq_id)
            self._pending.append(audit)

    def run(self, num_leftover_tokens: int, num_spare_blocks: int = 0) -> list[AuditResult]:
        """Advance the queued audits with up to min(num_leftover_tokens, the per-step cap)
        tokens; finish those whose recompute and cached logits are both in. Private blocks
        are taken only when num_spare_blocks free or evictable blocks remain besides."""
        budget = min(num_leftover_tokens, self.max_tokens_per_step)
        chunks = self._plan_chunks(budget, num_spare_blocks)
        if chunks:
            self._recompute(chunks)
        advanced = {audit.audit_id for audit, _ in chunks}
        results = []
        for audit in list(self._pending):
            if self._is_ready(audit):
                results.append(self._finish(audit))
            elif not audit.is_recomputed and audit.audit_id not in advanced:
                audit.num_idle_steps += 1
                if audit.num_idle_steps > MAX_IDLE_STEPS:
                    self._drop(audit)
        return results

    def drop_all(self) -> None:
        """Abandon every queued audit (e.g. after an error in one), counting them dropped."""
        for audit in list(self._pending):
            self._drop(audit)

    def drop_reading(self, block_ids: set[int]) -> None:
        """Abandon the queued audits of hits that reused one of block_ids (blocks whose KV a
        failed step never wrote: comparing them would report a corruption that is not one)."""
        for audit in list(self._pending):
            if block_ids.intersection(audit.hit.cached_block_ids):
                self._drop(audit)

    def drain_recent_max_abs_diffs(self) -> list[float]:
        """The max-abs-diffs of audits finished since the last call (the engine puts them in
        the step's stats snapshot; engine thread only, like everything here)."""
        diffs = list(self._recent_diffs)
        self._recent_diffs.clear()
        return diffs

    def _drop(self, audit: _Audit) -> None:
        self._release(audit)
        self.counters.num_dropped += 1

    def _release(self, audit: _Audit) -> None:
        self._pending.remove(audit)
        self.kv.release_blocks(audit.holder)
        self.runner.stop_capture(audit.hit.seq_id)

    # -- recomputation ----------------------------------------------------------------------
    def _plan_chunks(self, budget: int, num_spare_blocks: int) -> list[tuple[_Audit, int]]:
        chunks: list[tuple[_Audit, int]] = []
        for audit in self._pending:
            num_left = audit.num_prompt_tokens - audit.num_computed_tokens
            if budget == 0:
                break
            if num_left == 0:
                continue
            if not audit.private_block_ids:
                block_ids = self.kv.allocate_held_blocks(
                    audit.holder, audit.num_prompt_tokens, num_spare_blocks
                )
                self._save_spills()
                if block_ids is None:
                    continue
                audit.private_block_ids = block_ids
            num_tokens = min(num_left, budget)
            chunks.append((audit, num_tokens))
            budget -= num_tokens
        return chunks

    def _recompute(self, chunks: list[tuple[_Audit, int]]) -> None:
        """One eager forward over the chunks, writing only the audits' private blocks."""
        bs = self.kv.block_size
        seqs, slots, last = [], [], set()
        for audit, num_tokens in chunks:
            start, end = audit.num_computed_tokens, audit.num_computed_tokens + num_tokens
            block_ids = audit.private_block_ids[: self.kv.num_blocks_for(end)]
            token_ids = audit.hit.prompt_token_ids[start:end]
            seqs.append(
                ScheduledSeq(
                    audit.audit_id, token_ids, start, block_ids, prompt_len=audit.num_prompt_tokens
                )
            )
            slots += [block_ids[pos // bs] * bs + pos % bs for pos in range(start, end)]
            if end == audit.num_prompt_tokens:
                last.add(audit.audit_id)
        logits = self.runner.run_audit(SchedulerOutput(seqs=seqs, slot_mapping=slots), last)
        for audit, num_tokens in chunks:
            audit.num_computed_tokens += num_tokens
            audit.num_idle_steps = 0
            audit.recomputed_logits = logits.get(audit.audit_id, audit.recomputed_logits)

    def _is_ready(self, audit: _Audit) -> bool:
        """Recomputed, and the sequence's own logits are in (or will never come: it finished
        or failed before its first sample; then K/V alone are compared)."""
        if not audit.is_recomputed:
            return False
        if audit.cached_logits is None:
            audit.cached_logits = self.runner.take_prompt_logits(audit.hit.seq_id)
        if audit.cached_logits is not None:
            return True
        seq = self._get_seq(audit.hit.seq_id)
        return seq is None or seq.num_output_tokens > 0

    def _save_spills(self) -> None:
        """Cached blocks evicted for private blocks go to the second tier now, before the
        recompute writes them (no runner step reads them first, as it does a schedule's)."""
        spills = self.kv.take_block_spills()
        if spills:
            block_ids = [spill.block_id for spill in spills]
            self.kv.store_spilled(spills, read_blocks(self.runner.kv_caches, block_ids))

    # -- comparison -------------------------------------------------------------------------
    def _finish(self, audit: _Audit) -> AuditResult:
        diffs, errors = self._compare_kv(audit)
        max_diff, max_error = max(diffs), max(errors)
        logits_error = greedy_matches = None
        if audit.cached_logits is not None and audit.recomputed_logits is not None:
            diff, logits_error, greedy_matches = _compare_logits(
                audit.cached_logits, audit.recomputed_logits
            )
            max_diff, max_error = max(max_diff, diff), max(max_error, logits_error)
        cached = audit.hit.cached_block_ids
        bad = [b for b, error in zip(cached, errors, strict=True) if error > self.tolerance]
        verdict = Verdict.DRIFT
        if max_error > self.tolerance:
            verdict = Verdict.CORRUPTION
        elif max_error <= self.clean_tolerance and greedy_matches is not False:
            verdict = Verdict.CLEAN
        quarantined = self._act(audit, verdict, bad or list(cached), max_error)
        result = AuditResult(
            audit.hit.request_id, verdict, audit.hit.num_cached_tokens, max_diff, max_error,
            max(errors), logits_error, greedy_matches, bad, quarantined,
        )  # fmt: skip
        self._release(audit)
        self.recent_results.append(result)
        self._recent_diffs.append(result.max_abs_diff)
        return result

    def _act(self, audit: _Audit, verdict: Verdict, suspects: list[int], error: float) -> list[int]:
        self.counters.num_audits += 1
        is_restore = audit.hit.num_restored_tokens > 0
        self.counters.num_restore_audits += is_restore
        if verdict is Verdict.DRIFT:
            self.counters.num_drifts += 1
        if verdict is not Verdict.CORRUPTION:
            return []
        self.counters.num_corruptions += 1
        self.counters.num_restore_corruptions += is_restore
        quarantined = self.kv.quarantine(suspects)
        logger.warning(
            "prefix-cache audit of request %s: corruption (error %.3g > tolerance %.3g) in "
            "cached blocks %s; quarantined blocks %s",
            audit.hit.request_id, error, self.tolerance, suspects, quarantined,
        )  # fmt: skip
        return quarantined

    def _compare_kv(self, audit: _Audit) -> tuple[list[float], list[float]]:
        """Per reused block: (max abs diff, error) over every layer's K and V."""
        bs = self.kv.block_size
        cached = audit.hit.cached_block_ids
        num = len(cached)
        device = self.runner.device
        cached_ids, private_ids = split_to_device([cached, audit.private_block_ids[:num]], device)
        valid = torch.ones(num, bs, dtype=torch.bool, device=device)  # [N, bs]
        valid[-1, audit.hit.num_cached_tokens - (num - 1) * bs :] = False
        max_diff = torch.zeros(num, device=device)
        max_error = torch.zeros(num, device=device)
        with torch.inference_mode():
            for k_cache, v_cache in self.runner.kv_caches:
                for cache in (k_cache, v_cache):  # [num_blocks, bs, Hkv, D]
                    got = cache.index_select(0, cached_ids).float()  # [N, bs, Hkv, D]
                    want = cache.index_select(0, private_ids).float()
                    diff = (got - want).abs().amax(dim=(2, 3)).where(valid, 0.0)  # [N, bs]
                    scale = want.abs().amax(dim=(2, 3)).where(valid, 0.0).amax(1).clamp_min(1.0)
                    block_diff = _finite_or_inf(diff.amax(1))  # [N]
                    max_diff = torch.maximum(max_diff, block_diff)
                    max_error = torch.maximum(max_error, block_diff / scale)
        return max_diff.tolist(), max_error.tolist()


def _compare_logits(cached: torch.Tensor, recomputed: torch.Tensor) -> tuple[float, float, bool]:
    """(max abs diff, error, same argmax) of two [V] logits rows."""
    diff = _finite_or_inf((cached - recomputed).abs().amax())
    scale = recomputed.abs().amax().clamp_min(1.0)
    same = bool(cached.argmax() == recomputed.argmax())
    return float(diff), float(diff / scale), same


def _finite_or_inf(x: torch.Tensor) -> torch.Tensor:
    """NaN compares false with any tolerance: count it as an infinite difference."""
    return torch.where(torch.isfinite(x), x, torch.full_like(x, float("inf")))
