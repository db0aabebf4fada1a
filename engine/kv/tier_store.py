"""Where the second KV tier keeps its entries (torch-free): host memory, or files on local disk.

Both stores keep encoded entries (engine/kv/tier_format.py) by key and know nothing of their
meaning; engine/kv/kv_tier.py indexes, bounds and verifies them.

FileTierStore writes on a thread of its own, so the engine thread never waits on the disk: put()
keeps the bytes in memory until they are written (get() serves them from there meanwhile);
delete() unlinks at once. A
write goes to a temporary file in the same directory and is published by os.replace(), which
is atomic: a process killed mid-write leaves a temporary file, never an entry, and the next
start removes the temporary files. Files are not fsynced one by one: a torn file after a power
loss fails its checksum on load and is dropped, never served.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from engine.kv.tier_format import HEAD_PREFIX_LEN, EntryError, EntryHead, decode_head, head_length

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_MAX_HEAD_BYTES = 64 << 20  # a longer head is not one this code wrote
MAX_PENDING_BYTES = 256 << 20  # bytes put but not yet written, beyond which put() refuses


class StoredEntry(NamedTuple):
    key: str
    head: EntryHead | None  # None: not a readable entry of this format
    num_bytes: int


class TierStore(Protocol):
    kind: str  # "host" or "disk": the tier label of the metrics
    persistent: bool  # entries survive the process (warm restart)
    num_write_errors: int  # entries the store could not keep (a full disk); counted, dropped

    def put(self, key: str, data: bytes) -> bool:
        """Keep data under key; False (nothing kept, counted in num_write_errors) when the
        store cannot take it now."""
        ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def scan(self) -> Iterator[StoredEntry]:
        """Every stored entry, oldest first."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class MemoryTierStore:
    """Entries in host memory (the tier under a CUDA worker); gone with the process."""

    kind = "host"
    persistent = False
    num_write_errors = 0

    def __init__(self) -> None:
        self._entries: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> bool:
        self._entries[key] = data
        return True

    def get(self, key: str) -> bytes | None:
        return self._entries.get(key)

    def delete(self, key: str) -> None:
        self._entries.pop(key, None)

    def scan(self) -> Iterator[StoredEntry]:
        return iter(())

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class FileTierStore:
    """One file per entry, `<key>.kvb`, in `directory` (created if missing)."""

    kind = "disk"
    persistent = True

    def __init__(self, directory: str | Path, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.directory = Path(directory)
        self.max_pending_bytes = max_pending_bytes
        self._num_pending_bytes = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        # put, not yet published: key -> (its put number, its bytes)
        self._pending: dict[str, tuple[int, bytes]] = {}
        self._num_puts = 0
        self._lock = threading.Lock()
        self._ops: queue.Queue[tuple[str, int] | None] = queue.Queue()  # (key, put number)
        self.num_write_errors = 0
        self._writer = threading.Thread(
            target=self._write_loop, name="kvshare-kv-tier", daemon=True
        )
        self._writer.start()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def put(self, key: str, data: bytes) -> bool:
        """Queue data for the writer; False (refused, counted) while the bytes not yet written
        would pass max_pending_bytes: a disk slower than the spills never grows memory."""
        with self._lock:
            num_bytes = self._num_pending_bytes + len(data)
            if self._num_pending_bytes and num_bytes > self.max_pending_bytes:
                self.num_write_errors += 1
                return False
            self._unpend(key)
            self._num_puts += 1
            self._pending[key] = (self._num_puts, data)
            self._num_pending_bytes += len(data)
            self._ops.put((key, self._num_puts))
        return True

    def _unpend(self, key: str) -> None:
        """Forget key's bytes not yet written (the lock held)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._num_pending_bytes -= len(pending[1])

    def get(self, key: str) -> bytes | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending[1]
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        """Gone at once, from memory and disk: a put still queued finds nothing to write, one
        being written is unlinked (_publish checks under the same lock), so a deleted entry
        (a quarantined block's) cannot come back after a crash."""
        with self._lock:
            self._unpend(key)
            self.path(key).unlink(missing_ok=True)

    def scan(self) -> Iterator[StoredEntry]:
        """Published entries with their heads, oldest first; temporary files left by a killed
        writer are removed (they were never entries)."""
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX and path.is_file():
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.name, path, stat.st_size))
        for _, _, path, size in sorted(found):
            yield StoredEntry(path.stem, _read_head(path), size)

    def flush(self) -> None:
        """Return once every put() so far is on disk (or failed); at once after close()."""
        if self._writer.is_alive():
            self._ops.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self.flush()
            self._ops.put(None)
            self._writer.join(timeout=30.0)

    def _write_loop(self) -> None:
        while True:
            op = self._ops.get()
            try:
                if op is None:
                    return
                self._publish(*op)
            except Exception as exc:  # a full disk: the entry is dropped, the writer goes on
                with self._lock:
                    self.num_write_errors += 1
                logger.warning("KV tier: could not write entry %s: %s", op, exc)
            finally:
                self._ops.task_done()

    def _publish(self, key: str, number: int) -> None:
        """Write put number `number` of key, unless it was deleted or put again since (a later
        op of the queue does what is left). A failed write leaves neither a temporary file nor
        the bytes in memory: the entry is gone (counted missing when next looked up)."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is None or pending[0] != number:
            return
        tmp = self.directory / f"{_TMP_PREFIX}{os.getpid()}-{key}"
        try:
            tmp.write_bytes(pending[1])
            with self._lock:
                if self._pending.get(key) is not pending:  # deleted or put again meanwhile
                    tmp.unlink(missing_ok=True)
                    return
                os.replace(tmp, self.path(key))
                self._unpend(key)
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                if self._pending.get(key) is pending:
                    self._unpend(key)
            raise


def _read_head(path: Path) -> EntryHead | None:
    try:
        with path.open("rb") as handle:
            start = handle.read(HEAD_PREFIX_LEN)
            num_bytes = head_length(start)
            if num_bytes > _MAX_HEAD_BYTES:
                return None
            data = start + handle.read(num_bytes - len(start))
        return decode_head(data)[0]
    except (OSError, EntryError):
        return None
