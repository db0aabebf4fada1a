"""Per-tenant limits at the HTTP edge: each tenant's requests in flight, and the 429s when
one is over a limit (docs/fair-scheduling.md). Event loop only.

A request is waiting from its admission until its first output from the engine, then running
until it ends. The limits (off by default) are checked at admission against what is in
flight, and the request is counted at once (so a burst cannot pass them before any of it
runs): requests in flight (waiting or running: the engine runs every admitted request) at
max_running_requests_per_tenant, waiting requests at max_waiting_requests_per_tenant, or
waiting prompt tokens that this request would take over max_waiting_prompt_tokens_per_tenant
each refuse it with a 429 and Retry-After. The global max_waiting_requests
(app/routes/deps.py) applies as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.errors import APIError
from app.metrics import ServerMetrics

LIMIT_REASONS = ("running", "waiting", "prompt_tokens")  # the 429 counts' reason label


@dataclass
class TenantLoad:
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prompt_tokens: int = 0

    @property
    def is_idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0


class TenantLimitExceeded(APIError):
    """429: the tenant is over one of its limits; `reason` is one of LIMIT_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(
            429,
            message,
            type="rate_limit_error",
            code=f"tenant_{reason}_limit",
            headers={"Retry-After": "1"},
        )
        self.reason = reason


class TenantLoads:
    """The in-flight load of every tenant with a request in flight (idle ones are dropped).

    tenant None is the one shared tenant (no API keys). Limits of None are off.
    """

    def __init__(
        self,
        max_running: int | None = None,
        max_waiting: int | None = None,
        max_waiting_prompt_tokens: int | None = None,
    ) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.loads: dict[str | None, TenantLoad] = {}

    def check(self, tenant: str | None, num_prompt_tokens: int) -> None:
        """TenantLimitExceeded when a new request of num_prompt_tokens is over a limit."""
        load = self.loads.get(tenant, TenantLoad())
        num_in_flight = load.num_running + load.num_waiting  # every admitted one will run
        if self.max_running is not None and num_in_flight >= self.max_running:
            message = f"This tenant already has {num_in_flight} requests in flight (the limit)."
            raise TenantLimitExceeded("running", message)
        if self.max_waiting is not None and load.num_waiting >= self.max_waiting:
            message = f"This tenant already has {load.num_waiting} requests waiting (the limit)."
            raise TenantLimitExceeded("waiting", message)
        limit = self.max_waiting_prompt_tokens
        if limit is not None and load.num_waiting_prompt_tokens + num_prompt_tokens > limit:
            message = (
                f"This tenant's waiting prompt tokens ({load.num_waiting_prompt_tokens}) and "
                f"this request's ({num_prompt_tokens}) exceed the limit of {limit}."
            )
            raise TenantLimitExceeded("prompt_tokens", message)

    def arrive(self, tenant: str | None, num_prompt_tokens: int) -> None:
        load = self.loads.setdefault(tenant, TenantLoad())
        load.num_waiting += 1
        load.num_waiting_prompt_tokens += num_prompt_tokens

    def start(self, tenant: str | None, num_prompt_tokens: int) -> None:
        """Its first output came: waiting -> running."""
        load = self.loads[tenant]
        load.num_waiting -= 1
        load.num_waiting_prompt_tokens -= num_prompt_tokens
        load.num_running += 1

    def leave(self, tenant: str | None, num_prompt_tokens: int, was_running: bool) -> None:
        load = self.loads[tenant]
        if was_running:
            load.num_running -= 1
        else:
            load.num_waiting -= 1
            load.num_waiting_prompt_tokens -= num_prompt_tokens
        if load.is_idle:
            del self.loads[tenant]


@dataclass
class TenantTicket:
    """One request's place in its tenant's load, from arrival to its end (TenantGate.arrive)."""

    gate: TenantGate
    tenant: str | None
    num_prompt_tokens: int
    arrival: float  # time.monotonic() at the request's arrival
    is_running: bool = False
    _has_left: bool = field(default=False, repr=False)

    def first_output(self) -> None:
        """Its first output came from the engine: it runs; its queue time is observed."""
        if self.is_running:
            return
        self.is_running = True
        self.gate.loads.start(self.tenant, self.num_prompt_tokens)
        self.gate.metrics.observe_tenant_queue_time(self.tenant, time.monotonic() - self.arrival)

    def leave(self, num_generated_tokens: int) -> None:
        """It ended (any reason): out of the load; its tokens counted for its tenant."""
        if self._has_left:
            return
        self._has_left = True
        self.gate.loads.leave(self.tenant, self.num_prompt_tokens, self.is_running)
        self.gate.metrics.observe_tenant_tokens(
            self.tenant, self.num_prompt_tokens, num_generated_tokens
        )


class TenantGate:
    """The per-tenant limits and load of one app, with its per-tenant metrics."""

    def __init__(self, loads: TenantLoads, metrics: ServerMetrics) -> None:
        self.loads = loads
        self.metrics = metrics

    def check(self, tenant: str | None, num_prompt_tokens: int) -> None:
        """TenantLimitExceeded (a 429), counted per tenant and reason, when over a limit."""
        try:
            self.loads.check(tenant, num_prompt_tokens)
        except TenantLimitExceeded as e:
            self.metrics.observe_tenant_rejection(tenant, e.reason)
            raise

    def arrive(self, tenant: str | None, num_prompt_tokens: int, arrival: float) -> TenantTicket:
        self.loads.arrive(tenant, num_prompt_tokens)
        return TenantTicket(self, tenant, num_prompt_tokens, arrival)
