"""Stored responses (POST /v1/responses with store: true): the interface and its SQLite store.

A stored response is kept under a scope, the tenant that made it (API key and cache_salt,
scope_of()); every read names the scope, so another tenant's id reads as unknown. The store
is bounded by count, bytes and age. Age is per response; count and bytes are shared fairly
between the tenants (tenant_of(): a tenant's salts count as the tenant), so one tenant's flood
evicts its own oldest responses, not another's (_Holdings). One SQLite file (WAL,
synchronous=FULL) holds them: a response the client got back as stored was committed before
the answer left, so a restart or a kill -9 does not lose it. Replicas behind a router need
session affinity or a shared ResponseStore (the interface below) to see each other's responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

EVICTION_REASONS = ("ttl", "count", "bytes")


def scope_of(tenant: str | None, cache_salt: str | None) -> str:
    """The store scope of a request: its tenant (a hash of the API key, or None without keys)
    narrowed by its cache_salt, as the prefix cache's namespace is (app/serving/records.py)."""
    return json.dumps([tenant, cache_salt])


def tenant_of(scope: str) -> str | None:
    """The tenant of a scope: its salts share the tenant's part of the store's bounds, so a
    tenant gets no more room by sending more salts."""
    return json.loads(scope)[0]


@dataclass(frozen=True)
class StoredResponse:
    """What a chained request needs of its predecessor, and what GET returns."""

    response_id: str
    response: dict[str, Any]  # the Response object as POST /v1/responses returned it
    input_items: list[dict[str, Any]]  # every item used to generate it, the chain's included
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt it ran on
    output_token_ids: list[int] = field(default_factory=list)  # what it generated (EOS incl.)


@dataclass(frozen=True)
class StoreLimits:
    max_responses: int
    max_bytes: int
    ttl_seconds: float


class StoreObserver(Protocol):
    def observe_response_store(
        self, num_responses: int, num_bytes: int, evictions: dict[str, int]
    ) -> None:
        """The store now holds num_responses responses of num_bytes bytes; `evictions`
        counts what the last call evicted, by reason (ttl, count, bytes)."""


class ResponseStore(Protocol):
    """Stored responses by (scope, response id). Every method is safe to await from the event
    loop (none blocks it). An unknown id, an expired one and one stored under another scope
    are indistinguishable: all read as None / False."""

    async def put(self, scope: str, stored: StoredResponse) -> bool:
        """Keep `stored` (committed durably before it returns), evicting the oldest responses
        beyond the bounds. False (nothing kept) when it alone is larger than the byte bound."""
        ...

    async def get(self, scope: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, scope: str, response_id: str) -> bool:
        """True when it was there (and is gone now)."""
        ...

    async def input_items(self, scope: str, response_id: str) -> list[dict[str, Any]] | None:
        """The items used to generate the response, in order; None when unknown."""
        ...

    async def close(self) -> None: ...


class SqliteResponseStore:
    """ResponseStore in one SQLite file. All SQLite calls run on one worker thread (its own
    connection), in order; `clock` (seconds, time.time by default) dates entries for the TTL."""

    def __init__(
        self,
        path: str | Path,
        limits: StoreLimits,
        observer: StoreObserver | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.limits = limits
        self.observer = observer
        self.clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._connection: sqlite3.Connection | None = None

    # -- the async interface: each call is one job on the store's thread ----------------------

    async def open(self) -> None:
        await self._run(self._open)

    async def put(self, scope: str, stored: StoredResponse) -> bool:
        return await self._run(self._put, scope, stored)

    async def get(self, scope: str, response_id: str) -> StoredResponse | None:
        return await self._run(self._get, scope, response_id)

    async def delete(self, scope: str, response_id: str) -> bool:
        return await self._run(self._delete, scope, response_id)

    async def input_items(self, scope: str, response_id: str) -> list[dict[str, Any]] | None:
        stored = await self.get(scope, response_id)
        return None if stored is None else stored.input_items

    async def close(self) -> None:
        await self._run(self._close)
        self._executor.shutdown(wait=True)

    async def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, function, *args)

    # -- on the store's thread ------------------------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, isolation_level=None)  # transactions: ours
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        connection.execute("PRAGMA busy_timeout=5000")  # another process on the same file
        connection.create_function("tenant_of", 1, tenant_of, deterministic=True)
        connection.execute(
            "CREATE TABLE IF NOT EXISTS responses ("
            " seq INTEGER PRIMARY KEY AUTOINCREMENT,"  # insertion order: oldest first
            " response_id TEXT NOT NULL UNIQUE,"
            " scope TEXT NOT NULL,"
            " stored_at REAL NOT NULL,"
            " num_bytes INTEGER NOT NULL,"
            " body TEXT NOT NULL)"
        )
        # Each put sums every scope's holding (_Holdings): read from this index, not the bodies.
        connection.execute(
            "CREATE INDEX IF NOT EXISTS responses_by_scope ON responses (scope, num_bytes)"
        )
        self._connection = connection
        with self._transaction():
            evictions = {"ttl": self._evict_expired()}
        self._publish(evictions)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @property
    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            raise RuntimeError("the response store is not open")
        return self._connection

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _put(self, scope: str, stored: StoredResponse) -> bool:
        body = json.dumps(asdict(stored), ensure_ascii=False, separators=(",", ":"))
        num_bytes = len(body.encode())
        if num_bytes > self.limits.max_bytes:
            return False
        with self._transaction():
            evictions = {"ttl": self._evict_expired()}
            new_seq = self._db.execute(
                "INSERT INTO responses (response_id, scope, stored_at, num_bytes, body)"
                " VALUES (?, ?, ?, ?, ?)",
                (stored.response_id, scope, self.clock(), num_bytes, body),
            ).lastrowid
            assert new_seq is not None
            num_responses, total_bytes = self._totals()
            if num_responses > self.limits.max_responses or total_bytes > self.limits.max_bytes:
                holdings = _Holdings(self._db, tenant_of(scope), new_seq)  # room to make
                evictions["count"] = holdings.evict_over("count", self.limits.max_responses)
                evictions["bytes"] = holdings.evict_over("bytes", self.limits.max_bytes)
        self._publish(evictions)
        return True

    def _get(self, scope: str, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT body, stored_at FROM responses WHERE response_id = ? AND scope = ?",
            (response_id, scope),
        ).fetchone()
        if row is None:
            return None
        if row[1] <= self._expiry_cutoff():
            with self._transaction():
                evictions = {"ttl": self._evict_expired()}
            self._publish(evictions)
            return None
        return StoredResponse(**json.loads(row[0]))

    def _delete(self, scope: str, response_id: str) -> bool:
        with self._transaction():
            evictions = {"ttl": self._evict_expired()}
            cursor = self._db.execute(
                "DELETE FROM responses WHERE response_id = ? AND scope = ?", (response_id, scope)
            )
        self._publish(evictions)
        return cursor.rowcount > 0

    def _expiry_cutoff(self) -> float:
        return self.clock() - self.limits.ttl_seconds

    def _evict_expired(self) -> int:
        cutoff = self._expiry_cutoff()
        return self._db.execute("DELETE FROM responses WHERE stored_at <= ?", (cutoff,)).rowcount

    def _totals(self) -> tuple[int, int]:
        """The responses kept and their bytes."""
        return self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
        ).fetchone()

    def _publish(self, evictions: dict[str, int]) -> None:
        if self.observer is None:
            return
        num_responses, num_bytes = self._totals()
        self.observer.observe_response_store(num_responses, num_bytes, evictions)


@dataclass
class _Holding:
    """What one tenant holds (all its scopes): how much, and its oldest response's seq."""

    num_responses: int
    num_bytes: int
    oldest_seq: int


class _Holdings:
    """The tenants' holdings while one put makes room, on the store's thread, in its transaction.

    A tenant's share of a bound (count or bytes) is the bound divided by the number of tenants
    holding responses. While the store is over the bound, one response goes: the putting
    tenant's oldest if it is over its share and holds more than the new response; else the
    oldest of the other tenant holding the most (the furthest over its share), the older on a
    tie. The new response is never evicted. With one tenant this is the oldest first.
    """

    def __init__(self, db: sqlite3.Connection, putter: str | None, new_seq: int) -> None:
        self._db, self._putter, self._new_seq = db, putter, new_seq
        self._by_tenant: dict[str | None, _Holding] = {}
        rows = db.execute(  # by scope, then by tenant here: one tenant_of() call per scope
            "SELECT scope, COUNT(*), SUM(num_bytes), MIN(seq) FROM responses GROUP BY scope"
        )
        for scope, num_responses, num_bytes, oldest_seq in rows:
            holding = self._by_tenant.setdefault(tenant_of(scope), _Holding(0, 0, oldest_seq))
            holding.num_responses += num_responses
            holding.num_bytes += num_bytes
            holding.oldest_seq = min(holding.oldest_seq, oldest_seq)

    def evict_over(self, reason: str, bound: int) -> int:
        """Evict until the responses (reason "count") or their bytes ("bytes") are within
        `bound`; how many were evicted."""
        num_evicted = 0
        while sum(self._amount(h, reason) for h in self._by_tenant.values()) > bound:
            self._evict_oldest(self._victim(reason, bound))
            num_evicted += 1
        return num_evicted

    @staticmethod
    def _amount(holding: _Holding, reason: str) -> int:
        return holding.num_responses if reason == "count" else holding.num_bytes

    def _victim(self, reason: str, bound: int) -> str | None:
        putter = self._by_tenant[self._putter]
        is_over_share = self._amount(putter, reason) * len(self._by_tenant) > bound
        if is_over_share and putter.num_responses > 1:  # it holds more than the new one
            return self._putter
        # Others hold something: the sum is over the bound, and the putter is within its share
        # (so another is over its own) or holds only the new response, which fits alone.
        others = [tenant for tenant in self._by_tenant if tenant != self._putter]
        by_tenant = self._by_tenant
        return max(
            others, key=lambda t: (self._amount(by_tenant[t], reason), -by_tenant[t].oldest_seq)
        )

    def _evict_oldest(self, tenant: str | None) -> None:
        holding = self._by_tenant[tenant]
        oldest = self._db.execute(
            "SELECT seq, num_bytes FROM responses WHERE seq >= ? AND seq != ?"
            " AND tenant_of(scope) IS ? ORDER BY seq LIMIT 2",
            (holding.oldest_seq, self._new_seq, tenant),
        ).fetchall()
        seq, num_bytes = oldest[0]
        self._db.execute("DELETE FROM responses WHERE seq = ?", (seq,))
        holding.num_responses -= 1
        holding.num_bytes -= num_bytes
        if holding.num_responses == 0:
            del self._by_tenant[tenant]
        else:  # the next evictable one (the putter's new response only when it is all it holds)
            holding.oldest_seq = oldest[1][0] if len(oldest) > 1 else self._new_seq
