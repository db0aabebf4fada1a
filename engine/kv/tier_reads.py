"""Reading the second tier's entries off the engine thread (torch-free): the file reads and
checksums of a waiting sequence's tier blocks run on a reader thread while the engine goes on
stepping the other sequences; the sequence is admitted once they are in (engine/kv/tier_link.py).

fetch() is what runs there: it reads and decodes entries (the CRC is checked in decode_entry) and
touches neither the index nor the counters; KVTier.accept() then checks each result against the
index on the engine thread (fingerprint, namespace, token path) and counts it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from engine.kv.tier_format import EntryError, EntryHead, decode_entry
from engine.kv.tier_store import TierStore


@dataclass(frozen=True)
class Located:
    """An indexed entry to read: its key and the token path it must hold."""

    key: str
    path: tuple[int, ...]


@dataclass(frozen=True)
class Fetched:
    """What reading one entry gave: its head and payload (checksum verified), or why not."""

    entry: tuple[EntryHead, bytes] | None
    error: str = ""  # "missing" or the EntryError's message


@dataclass(frozen=True)
class Fetch:
    located: tuple[Located, ...]
    results: tuple[Fetched, ...]  # one per located entry, up to the first that failed
    seconds: float


def fetch(store: TierStore, located: tuple[Located, ...]) -> Fetch:
    """Read and decode each entry in order, stopping after the first that fails."""
    started = time.perf_counter()
    results: list[Fetched] = []
    for one in located:
        data = store.get(one.key)
        if data is None:
            results.append(Fetched(None, "missing"))
            break
        try:
            results.append(Fetched(decode_entry(data)))
        except EntryError as exc:
            results.append(Fetched(None, str(exc)))
            break
    return Fetch(located, tuple(results), time.perf_counter() - started)


class ReadAhead:
    """One read in flight or done per waiting sequence, on one reader thread."""

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-kv-tier-read")
        self._reads: dict[int, Future[Fetch]] = {}
        self._wanted: dict[int, tuple[Located, ...]] = {}

    def poll(self, seq_id: int, located: tuple[Located, ...]) -> bool:
        """Whether seq's read of `located` is done; starts it (replacing a read of other
        entries) when there is none."""
        if self._wanted.get(seq_id) != located:
            self.forget(seq_id)
            self._wanted[seq_id] = located
            self._reads[seq_id] = self._pool.submit(fetch, self.store, located)
        return self._reads[seq_id].done()

    def take(self, seq_id: int, located: tuple[Located, ...]) -> Fetch | None:
        """The finished read of exactly `located` for seq (then forgotten), else None."""
        future = self._reads.get(seq_id)
        if future is None or self._wanted.get(seq_id) != located or not future.done():
            return None
        self.forget(seq_id)
        return future.result()

    def forget(self, seq_id: int) -> None:
        future = self._reads.pop(seq_id, None)
        self._wanted.pop(seq_id, None)
        if future is not None:
            future.cancel()

    def wait_any(self, timeout_s: float) -> None:
        """Block up to timeout_s until a read in flight finishes (an idle engine's wait)."""
        pending = [future for future in self._reads.values() if not future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    @property
    def num_in_flight(self) -> int:
        return sum(not future.done() for future in self._reads.values())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
