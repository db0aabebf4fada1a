"""Which waiting sequences the scheduler admits first (torch-free).

Admission order (scheduling_policy):
  fcfs                  queue order (preempted sequences go back to the front).
  fair-share            the head of the tenant with the least virtual token counter, lazily
                        (engine/sched/fair_share.py); queue order within a tenant.
Every policy first orders by priority (lower first, a stable sort: queue order among equals);
under longest-prefix-first the prefix length then decides and priority breaks its ties.
  longest-prefix-first  the first LPF_WINDOW waiting sequences by cached prefix length
                        (longest first, queue order on ties); one that arrived more than
                        LPF_MAX_WAIT_STEPS steps ago goes first regardless, so nothing starves.
With the prefix cache, a waiting sequence whose next uncached full blocks are being prefilled
by a running sequence of its namespace (its "leader", not inserted yet) is held this step:
it is admitted once the leader has inserted them, or has left prefill, and then reuses them.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.config import SCHEDULING_POLICIES
from engine.core.sequence import Sequence
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.fair_share import FairShare, by_priority

LPF_WINDOW = 64  # waiting sequences looked up per step (a lookup costs O(tokens))
LPF_MAX_WAIT_STEPS = 32  # the age bound of longest-prefix-first, in scheduler steps


class AdmissionPolicy:
    """Orders the waiting queue and holds followers; reads the KV cache, never changes it."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        scheduling_policy: str,
        fair_share: FairShare | None = None,
    ) -> None:
        assert scheduling_policy in SCHEDULING_POLICIES, scheduling_policy
        self.kv_cache_manager = kv_cache_manager
        self.scheduling_policy = scheduling_policy
        self.fair_share = fair_share or FairShare()

    def order(self, waiting: Iterable[Sequence], step_index: int) -> Iterable[Sequence]:
        """The waiting sequences in the order to try them at scheduler step step_index
        (fair-share: a lazy iterator that reads the counters as the step charges them)."""
        waiting = by_priority(waiting)
        if self.scheduling_policy == "fcfs":
            return waiting
        if self.scheduling_policy == "fair-share":
            return self.fair_share.order(waiting)
        window, rest = waiting[:LPF_WINDOW], waiting[LPF_WINDOW:]
        is_aged = [step_index - s.arrival_step > LPF_MAX_WAIT_STEPS for s in window]
        aged = [s for s, old in zip(window, is_aged, strict=True) if old]
        young = [s for s, old in zip(window, is_aged, strict=True) if not old]
        young.sort(key=lambda s: -self.kv_cache_manager.cached_prefix_len(s))  # stable
        return aged + young + rest

    def is_held(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """In-batch sharing: True while a running, prefilling sequence of seq's namespace
        (a leader) is computing tokens seq could reuse once the leader has inserted them
        (tokens shared with seq in blocks the leader's prefill fills), beyond what seq
        could reuse now.

        Bounded: the leader inserts its full blocks after every chunk, so all of them once
        its prefill ends, and stops being a leader when it decodes or leaves the running list.
        """
        kv = self.kv_cache_manager
        if not kv.is_prefix_caching:
            return False
        token_ids = seq.token_slice(0, seq.num_tokens - 1)  # the most a match may cover
        num_cached = None
        for leader in running:
            if leader.is_decoding or leader.cache_namespace != seq.cache_namespace:
                continue
            num_filled = leader.num_tokens // kv.block_size * kv.block_size
            num_reusable = leader.num_shared_tokens(token_ids[:num_filled], kv.block_size)
            if num_reusable <= kv.num_inserted_tokens(leader):
                continue
            if num_cached is None:
                num_cached = kv.cached_prefix_len(seq)
            if num_reusable > num_cached:
                return True
        return False
