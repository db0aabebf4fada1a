"""SqliteResponseStore on a real SQLite file: scopes, TTL (an injected clock), count and byte
bounds (oldest evicted first, within each tenant's share), and a new store object on the same
file."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from pathlib import Path

import pytest

from app.responses.store import (
    SqliteResponseStore,
    StoredResponse,
    StoreLimits,
    scope_of,
    tenant_of,
)

pytestmark = pytest.mark.anyio

A, B = scope_of("tenant-a", None), scope_of("tenant-b", None)
BIG = StoreLimits(max_responses=100, max_bytes=1 << 20, ttl_seconds=1000.0)


class Recorder:
    """The observer: the last sizes published and every eviction by reason."""

    def __init__(self) -> None:
        self.num_responses = self.num_bytes = -1
        self.evictions = {"ttl": 0, "count": 0, "bytes": 0}

    def observe_response_store(self, num_responses, num_bytes, evictions) -> None:
        self.num_responses, self.num_bytes = num_responses, num_bytes
        for reason, count in evictions.items():
            self.evictions[reason] += count


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(response_id: str, text: str = "x") -> StoredResponse:
    item = {"id": "msg_" + response_id, "type": "message", "role": "user", "content": text}
    return StoredResponse(response_id, {"id": response_id, "text": text}, [item], [1, 2], [3])


def size_of(entry: StoredResponse) -> int:
    return len(json.dumps(asdict(entry), ensure_ascii=False, separators=(",", ":")).encode())


async def open_store(path: Path, limits: StoreLimits = BIG, **kwargs) -> SqliteResponseStore:
    store = SqliteResponseStore(path, limits, **kwargs)
    await store.open()
    return store


async def test_a_response_is_read_back_only_in_its_scope(tmp_path: Path) -> None:
    store = await open_store(tmp_path / "r.sqlite3")
    assert await store.put(A, stored("r1", "héllo 🙂")) is True
    assert await store.get(A, "r1") == stored("r1", "héllo 🙂")
    assert await store.input_items(A, "r1") == stored("r1", "héllo 🙂").input_items
    assert await store.get(B, "r1") is None
    assert await store.get(scope_of("tenant-a", "salt"), "r1") is None
    assert await store.input_items(B, "r1") is None
    assert await store.delete(B, "r1") is False  # another scope cannot delete it either
    assert await store.delete(A, "r1") is True
    assert await store.get(A, "r1") is None
    assert await store.delete(A, "r1") is False
    await store.close()


def test_scopes_keep_tenant_and_salt_apart() -> None:
    assert scope_of("a", "b:c") != scope_of("a:b", "c")
    assert scope_of(None, None) != scope_of(None, "")
    assert scope_of(None, '["a", null]') != scope_of("a", None)


async def test_ttl_expiry_by_the_injected_clock(tmp_path: Path) -> None:
    clock, recorder = Clock(), Recorder()
    limits = StoreLimits(max_responses=100, max_bytes=1 << 20, ttl_seconds=60.0)
    store = await open_store(tmp_path / "r.sqlite3", limits, observer=recorder, clock=clock)
    await store.put(A, stored("old"))
    clock.now += 30.0
    await store.put(A, stored("new"))
    clock.now += 29.0  # old: 59 s
    assert await store.get(A, "old") is not None
    clock.now += 1.0  # old: 60 s, expired; new: 30 s
    assert await store.get(A, "old") is None
    assert recorder.evictions == {"ttl": 1, "count": 0, "bytes": 0}
    assert (recorder.num_responses, recorder.num_bytes) == (1, size_of(stored("new")))
    assert await store.get(A, "new") is not None
    clock.now += 30.0
    assert await store.delete(A, "new") is False  # expired: as if unknown
    assert recorder.evictions["ttl"] == 2
    assert recorder.num_responses == 0
    await store.close()


@pytest.mark.parametrize("tenant", [None, "tenant-a"])
async def test_count_bound_evicts_the_oldest_first(tmp_path: Path, tenant: str | None) -> None:
    """One tenant (no API keys, or one key), its salts alike: the oldest response goes first."""
    recorder = Recorder()
    limits = StoreLimits(max_responses=3, max_bytes=1 << 20, ttl_seconds=1000.0)
    store = await open_store(tmp_path / "r.sqlite3", limits, observer=recorder)
    scopes = [scope_of(tenant, None), scope_of(tenant, "salt")]
    for number in range(5):
        await store.put(scopes[number % 2], stored(f"r{number}"))
    kept = [n for n in range(5) if await store.get(scopes[n % 2], f"r{n}") is not None]
    assert kept == [2, 3, 4]
    assert recorder.evictions == {"ttl": 0, "count": 2, "bytes": 0}
    assert recorder.num_responses == 3
    await store.close()


async def test_byte_bound_evicts_the_oldest_first(tmp_path: Path) -> None:
    recorder = Recorder()
    entries = [stored(f"r{n}", "y" * 100) for n in range(4)]
    size = size_of(entries[0])
    limits = StoreLimits(max_responses=100, max_bytes=2 * size + size // 2, ttl_seconds=1000.0)
    store = await open_store(tmp_path / "r.sqlite3", limits, observer=recorder)
    for entry in entries[:3]:
        assert await store.put(A, entry) is True
    assert [await store.get(A, e.response_id) is not None for e in entries[:3]] == [0, 1, 1]
    assert recorder.evictions == {"ttl": 0, "count": 0, "bytes": 1}
    assert (recorder.num_responses, recorder.num_bytes) == (2, 2 * size)
    # One larger than the whole bound is refused, and evicts nothing.
    assert await store.put(A, stored("huge", "z" * (3 * size))) is False
    assert await store.get(A, "huge") is None
    assert recorder.num_responses == 2 and recorder.evictions["bytes"] == 1
    await store.close()


# -- eviction per tenant: the one over its share evicts its own oldest ----------------------

SALTED_A = scope_of("tenant-a", "s1")
C = scope_of("tenant-c", None)
SCOPES = {"a": A, "A": SALTED_A, "b": B, "c": C}  # "A": tenant a under a cache_salt


def test_a_scope_s_tenant_is_its_api_key_s_whatever_the_salt() -> None:
    assert tenant_of(A) == tenant_of(SALTED_A) == "tenant-a"
    assert tenant_of(scope_of(None, "s1")) is None


async def survivors(store: SqliteResponseStore, ids: list[str]) -> list[str]:
    """Which of `ids` (a first letter naming the scope, SCOPES) the store still has."""
    return [i for i in ids if await store.get(SCOPES[i[0]], i) is not None]


# Puts in order; each id's first letter names its scope (SCOPES), all of one size.
TWO_TENANTS = (
    # bound 4, share 2: b1 finds a over its share (a1 goes), b2 too (a2), b3 is over its own (b1)
    ["a1", "a2", "a3", "a4", "b1", "b2", "b3"],
    ["a3", "a4", "b2", "b3"],
    3,
)
THREE_TENANTS = (
    # bound 6, share 2; a's salted and plain responses are one tenant's. c1: a and b hold 3
    # each, a's oldest is older (A1 goes); c2: b holds the most (b1); c3: c is over (c1).
    ["A1", "a2", "b1", "b2", "A3", "b3", "c1", "c2", "c3"],
    ["a2", "b2", "A3", "b3", "c2", "c3"],
    3,
)


@pytest.mark.parametrize("reason", ["count", "bytes"])
@pytest.mark.parametrize(
    ("puts", "kept", "num_evicted"), [TWO_TENANTS, THREE_TENANTS], ids=["two", "three"]
)
async def test_the_tenant_over_its_share_evicts_its_own_oldest(
    tmp_path: Path, reason: str, puts: list[str], kept: list[str], num_evicted: int
) -> None:
    """The bound holds len(kept) responses, counted (reason "count") or in bytes ("bytes")."""
    recorder = Recorder()
    size = size_of(stored("a1"))
    if reason == "count":
        limits = StoreLimits(max_responses=len(kept), max_bytes=1 << 20, ttl_seconds=1000.0)
    else:
        limits = StoreLimits(100, max_bytes=len(kept) * size + size // 2, ttl_seconds=1000.0)
    store = await open_store(tmp_path / "r.sqlite3", limits, observer=recorder)
    for response_id in puts:
        assert await store.put(SCOPES[response_id[0]], stored(response_id)) is True
    assert await survivors(store, puts) == kept
    assert recorder.evictions == {"ttl": 0, "count": 0, "bytes": 0, reason: num_evicted}
    assert (recorder.num_responses, recorder.num_bytes) == (len(kept), len(kept) * size)
    await store.close()


async def test_byte_shares_of_unequal_responses(tmp_path: Path) -> None:
    recorder = Recorder()
    small, big = size_of(stored("a1", "y" * 100)), size_of(stored("b1", "y" * 400))
    bound = 4 * small + small // 2  # each tenant's share: half of it, less than `big`
    assert (small, big, bound) == (377, 977, 1696)
    limits = StoreLimits(max_responses=100, max_bytes=bound, ttl_seconds=1000.0)
    store = await open_store(tmp_path / "r.sqlite3", limits, observer=recorder)
    for response_id in ("a1", "a2", "a3"):
        await store.put(A, stored(response_id, "y" * 100))
    # b1 alone is over b's share, but it is b's only response: a, the other, makes room.
    await store.put(B, stored("b1", "y" * 400))
    assert await survivors(store, ["a1", "a2", "a3", "b1"]) == ["a3", "b1"]
    # b2 puts b over its share with an older response of its own: b1 goes, a3 stays.
    await store.put(B, stored("b2", "y" * 100))
    assert await survivors(store, ["a3", "b1", "b2"]) == ["a3", "b2"]
    assert recorder.evictions == {"ttl": 0, "count": 0, "bytes": 3}
    assert (recorder.num_responses, recorder.num_bytes) == (2, 2 * small)
    await store.close()


async def test_more_tenants_than_the_count_bound_never_evict_the_new_response(
    tmp_path: Path,
) -> None:
    """c1 is over its share (2 / 3) but is all c holds: a and b tie, a's is the oldest."""
    limits = StoreLimits(max_responses=2, max_bytes=1 << 20, ttl_seconds=1000.0)
    store = await open_store(tmp_path / "r.sqlite3", limits)
    for response_id in ("a1", "b1", "c1"):
        assert await store.put(SCOPES[response_id[0]], stored(response_id)) is True
    assert await survivors(store, ["a1", "b1", "c1"]) == ["b1", "c1"]
    await store.close()


async def test_a_new_store_on_the_same_file_has_everything(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite3"
    store = await open_store(path)
    await store.put(A, stored("r1"))
    await store.put(B, stored("r2"))
    await store.close()
    recorder = Recorder()
    again = await open_store(path, observer=recorder)
    assert (recorder.num_responses, recorder.num_bytes) == (2, 2 * size_of(stored("r1")))
    assert await again.get(A, "r1") == stored("r1")
    assert await again.get(B, "r2") == stored("r2")
    assert await again.get(A, "r2") is None
    await again.close()


async def test_the_file_is_in_wal_mode_and_readable_by_sqlite_itself(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = await open_store(path)
    await store.put(A, stored("r1"))
    with sqlite3.connect(path) as other:  # another connection sees the committed row
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        rows = other.execute("SELECT response_id, scope FROM responses").fetchall()
    assert rows == [("r1", A)]
    await store.close()
