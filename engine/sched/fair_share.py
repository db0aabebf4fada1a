"""Fair share between tenants: the virtual token counter (VTC) and request priority (torch-free).

VTC ("Fairness in Serving Large Language Models", OSDI 2024): every tenant has a counter of
the weighted service it got (prompt tokens computed, prompt tokens served from the prefix
cache, output tokens, each with its weight). Admission and prefill-chunk order serve the
backlogged tenant with the least counter first. A tenant that becomes active (no live
request before this one) has its counter lifted to the least of the active tenants', so it
cannot bank credit while idle. Within a tenant: priority (lower first), then arrival order.

Preemption (preemption_victim): a tenant's fair share of the KV pool is an even split among
the tenants running. The victim is a sequence of the largest tenant over its share, else of the
tenant short of blocks; priority then picks among that tenant's own sequences.

The prefill cap (PrefillCap): while two or more tenants are active (ActiveTenants: a live
request, or the last one ended less than a window ago), the least-served active tenant
prefills under the step's budget and everyone else's prefill tokens in the step share a small
cap. A step costs about linear time in its prefill tokens on a CPU, so short steps bound how
long a tenant that sends a request waits for the step in progress. And when the favoured
tenant has a request waiting for its first chunk, the Scheduler gives it a step of its own
(Scheduler._solo_tenant): the others wait that one step, never two in a row.

With one tenant (no API keys) every order here is queue order and no cap applies: fair share
is then fcfs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from engine.core.sequence import Sequence


@dataclass(frozen=True)
class FairShareWeights:
    """Service per token, by kind: a cached prompt token costs less than a computed one."""

    prompt: float = 1.0
    cached_prompt: float = 0.1
    output: float = 2.0


def by_priority(waiting: Iterable[Sequence]) -> list[Sequence]:
    """Lower priority value first; queue order among equals (a stable sort)."""
    return sorted(waiting, key=lambda seq: seq.priority)


def preemption_victim(
    running: list[Sequence],
    scheduled_ids: set[int],
    requester: Sequence | None = None,
    num_total_blocks: int = 0,
) -> Sequence:
    """The running sequence to preempt, among those not scheduled this step: the highest
    priority value (the lowest priority), the newest (last in `running`) among equals.

    Fair share (given the `requester`, the sequence short of blocks): only one tenant's
    candidates compete, so priority never compares two tenants. Of the tenants over their
    share of the pool (tenants_over_share) with a candidate, the one holding the most blocks
    (ties: the newest candidate's); with none, the requester's own. A tenant within its share
    never loses a sequence to another tenant.
    """
    candidates = [
        (index, seq) for index, seq in enumerate(running) if seq.seq_id not in scheduled_ids
    ]
    if requester is not None:
        tenant = _tenant_to_preempt(running, candidates, requester.tenant, num_total_blocks)
        candidates = [(index, seq) for index, seq in candidates if seq.tenant == tenant]
    _, index = max((seq.priority, index) for index, seq in candidates)
    return running[index]


def blocks_by_tenant(running: Iterable[Sequence]) -> dict[str, int]:
    """KV blocks each tenant's running sequences hold, a block they share counted once."""
    block_ids: dict[str, set[int]] = {}
    for seq in running:
        block_ids.setdefault(seq.tenant, set()).update(seq.block_ids)
    return {tenant: len(ids) for tenant, ids in block_ids.items()}


def tenants_over_share(num_blocks: dict[str, int], num_total_blocks: int) -> set[str]:
    """Tenants holding more than their fair share: the pool split evenly among the tenants
    in `num_blocks` (those running). One tenant alone is never over it."""
    num_tenants = len(num_blocks)
    return {tenant for tenant, n in num_blocks.items() if n * num_tenants > num_total_blocks}


def _tenant_to_preempt(
    running: list[Sequence],
    candidates: list[tuple[int, Sequence]],
    requester_tenant: str,
    num_total_blocks: int,
) -> str:
    num_blocks = blocks_by_tenant(running)
    over = tenants_over_share(num_blocks, num_total_blocks)
    newest = {seq.tenant: index for index, seq in candidates if seq.tenant in over}
    if not newest:
        return requester_tenant
    return max(newest, key=lambda tenant: (num_blocks[tenant], newest[tenant]))


@dataclass
class PrefillCap:
    """One step's prefill limit while two or more tenants are active.

    `favoured` (the least-served active tenant) prefills under the step's budget alone; the
    other tenants' prefill tokens together take at most num_tokens_left, which the favoured
    tenant's own tokens use up as well: a step that carries its prompt carries little else.
    """

    favoured: str
    num_tokens_left: int

    def limit(self, tenant: str) -> int | None:
        """The most prefill tokens `tenant` may still take this step; None: no limit."""
        return None if tenant == self.favoured else self.num_tokens_left

    def take(self, num_tokens: int) -> None:
        """num_tokens of prefill (anyone's) were scheduled."""
        self.num_tokens_left = max(0, self.num_tokens_left - num_tokens)


class ActiveTenants:
    """Which tenants are active: those with a live request, and those whose last request
    ended less than window_seconds ago (window 0: live ones only).

    The Scheduler observes the live tenants at the start and the end of every step and
    after an abort, so a tenant that is found without a request counts as ended then.
    """

    def __init__(self, window_seconds: float) -> None:
        self.window_seconds = window_seconds
        self._last_live: dict[str, float] = {}  # tenant -> when it was last seen live
        self._live: set[str] = set()  # live at the previous observation

    def observe(self, live_tenants: Iterable[str], now: float) -> list[str]:
        """The active tenants at `now`: the live ones in the order given, then the others."""
        live = list(dict.fromkeys(live_tenants))
        for tenant in [*live, *self._live]:  # live until now, or ended since the last look
            self._last_live[tenant] = now
        self._live = set(live)
        self._last_live = {
            tenant: seen for tenant, seen in self._last_live.items()
            if now - seen < self.window_seconds or tenant in self._live
        }  # fmt: skip
        return [*live, *(tenant for tenant in self._last_live if tenant not in self._live)]


class FairShare:
    """The tenants' virtual token counters, and which tenants are active for the prefill cap
    (prefill_tokens per step, 0: no cap). Engine thread only; the Scheduler charges it and
    calls observe() whenever requests may have ended (after a step, an abort)."""

    def __init__(
        self,
        weights: FairShareWeights | None = None,
        prefill_tokens: int = 0,
        active_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.weights = weights or FairShareWeights()
        self.counters: dict[str, float] = {}  # tenant -> weighted service so far
        self.prefill_tokens = prefill_tokens
        self.active_tenants = ActiveTenants(active_seconds)
        self.clock = clock

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

    def observe(self, live_tenants: Iterable[str]) -> list[str]:
        """The active tenants now, the live ones (in the order given) first; tracked only
        while there is a cap."""
        if self.prefill_tokens == 0:
            return []
        return self.active_tenants.observe(live_tenants, self.clock())

    def prefill_cap(self, live_tenants: Iterable[str], prefilling: set[str]) -> PrefillCap | None:
        """This step's cap, or None (no cap, or fewer than two active tenants). It favours
        the active tenant with the least counter; on a tie, one with no prefill running
        (just lifted to the counter of one that has), then the first live."""
        active = self.observe(live_tenants)
        if len(active) < 2:
            return None
        favoured = min(active, key=lambda t: (self.counter(t), t in prefilling))
        return PrefillCap(favoured, self.prefill_tokens)
