"""Fair share between tenants: the virtual token counter (VTC) and request priority (torch-free).

VTC ("Fairness in Serving Large Language Models", OSDI 2024): every tenant has a counter of
the weighted service it got (prompt tokens computed, prompt tokens served from the prefix
cache, output tokens, each with its weight). Admission and prefill-chunk order serve the
backlogged tenant with the least counter first. A tenant that becomes active (no live
request before this one) has its counter lifted to the least of the active tenants', so it
cannot bank credit while idle. Within a tenant: priority (lower first), then arrival order.

With one tenant (no API keys) every order here is queue order: fair share is then fcfs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engine.core.sequence import Sequence

MIN_PRIORITY = -1_000_000  # the `priority` extension field's bounds (vLLM: lower runs first)
MAX_PRIORITY = 1_000_000


@dataclass(frozen=True)
class FairShareWeights:
    """Service per token, by kind: a cached prompt token costs less than a computed one."""

    prompt: float = 1.0
    cached_prompt: float = 0.1
    output: float = 2.0


def by_priority(waiting: Iterable[Sequence]) -> list[Sequence]:
    """Lower priority value first; queue order among equals (a stable sort)."""
    return sorted(waiting, key=lambda seq: seq.priority)


def preemption_victim(running: list[Sequence], scheduled_ids: set[int]) -> Sequence:
    """The running sequence to preempt: not scheduled this step, the highest priority value
    (the lowest priority), the newest (last in `running`) among equals."""
    candidates = [
        (seq.priority, index) for index, seq in enumerate(running)
        if seq.seq_id not in scheduled_ids
    ]  # fmt: skip
    return running[max(candidates)[1]]


class FairShare:
    """The tenants' virtual token counters. Engine thread only; the Scheduler charges it."""

    def __init__(self, weights: FairShareWeights | None = None) -> None:
        self.weights = weights or FairShareWeights()
        self.counters: dict[str, float] = {}  # tenant -> weighted service so far

    def activate(self, tenant: str, active_tenants: Iterable[str]) -> None:
        """tenant gets a request and had none live: lift its counter to the least of the
        active tenants'. Counters at or below that least are forgotten (a lift would give
        them the same value), so only tenants still owing service are remembered."""
        active = {t: self.counters.get(t, 0.0) for t in active_tenants if t != tenant}
        floor = min(active.values(), default=None)
        if floor is None:
            self.counters = {tenant: 0.0}  # nobody active: everyone starts level
            return
        own = self.counters.get(tenant, 0.0)
        self.counters = {t: c for t, c in self.counters.items() if t in active or c > floor}
        self.counters[tenant] = max(own, floor)

    def charge_prompt(self, tenant: str, num_computed: int, num_cached: int = 0) -> None:
        weights = self.weights
        service = num_computed * weights.prompt + num_cached * weights.cached_prompt
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service

    def charge_output(self, tenant: str, num_tokens: int = 1) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + num_tokens * self.weights.output

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def spread(self) -> float:
        """max - min over the remembered counters (0 with one tenant)."""
        values = self.counters.values()
        return max(values) - min(values) if values else 0.0

    def order(self, waiting: Iterable[Sequence]) -> Iterator[Sequence]:
        """The waiting sequences to try, lazily: each next one is the head of the tenant with
        the least counter NOW (the Scheduler charges between yields); ties go to the earlier
        in `waiting`. Within a tenant, the order of `waiting` (pass it by_priority)."""
        queues: dict[str, list[Sequence]] = {}
        first_index: dict[str, list[int]] = {}
        for index, seq in enumerate(waiting):
            queues.setdefault(seq.tenant, []).append(seq)
            first_index.setdefault(seq.tenant, []).append(index)
        heads = dict.fromkeys(queues, 0)
        while heads:
            tenant = min(heads, key=lambda t: (self.counter(t), first_index[t][heads[t]]))
            yield queues[tenant][heads[tenant]]
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del heads[tenant]

    def order_running(self, running: Iterable[Sequence]) -> list[Sequence]:
        """Running sequences for prefill chunks: least counter first, then queue order."""
        return sorted(running, key=lambda seq: self.counter(seq.tenant))
