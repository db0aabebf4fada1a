"""The second KV tier on its own (torch-free): the entry format and its checksum, the index
(exact token paths within a namespace), its bounds, invalidation, and the file store's restart
and atomic publish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.kv.kv_tier import KVTier
from engine.kv.tier_format import (
    EntryError,
    EntryHead,
    decode_entry,
    encode_entry,
    entry_key,
)
from engine.kv.tier_store import FileTierStore, MemoryTierStore

BS = 4
NS_A = ("w0", "", "tenant-a")
NS_B = ("w0", "", "tenant-b")
PROMPT = list(range(10, 26))  # four blocks


def payload(tag: int, size: int = 64) -> bytes:
    return bytes((tag + i) % 256 for i in range(size))


def tier(store=None, max_bytes: int = 1 << 20, **options) -> KVTier:
    return KVTier(store or MemoryTierStore(), "fp-1", BS, max_bytes, **options)


def fill(t: KVTier, namespace, tokens: list[int], num_blocks: int) -> None:
    for index in range(num_blocks):
        t.add(namespace, tokens[: (index + 1) * BS], payload(index))


# -- format ------------------------------------------------------------------------------------
def test_an_entry_round_trips_and_any_flipped_bit_or_cut_is_detected() -> None:
    head = EntryHead("fp-1", NS_A, tuple(PROMPT[:8]), 64)
    data = encode_entry(head, payload(3))
    assert decode_entry(data) == (head, payload(3))
    for position in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[position] ^= 1 << (position % 8)
        with pytest.raises(EntryError):
            decode_entry(bytes(flipped))
    for cut in (1, 4, len(data) // 2, len(data) - 1):
        with pytest.raises(EntryError):
            decode_entry(data[:cut])


def test_entry_names_differ_by_namespace_and_by_every_token() -> None:
    base = entry_key(NS_A, PROMPT[:8])
    assert entry_key(NS_B, PROMPT[:8]) != base
    assert entry_key(NS_A, [*PROMPT[:7], 99]) != base
    assert entry_key(NS_A, PROMPT[:8]) == base


# -- index --------------------------------------------------------------------------------------
def test_match_continues_a_given_number_of_blocks_and_needs_every_token_equal() -> None:
    t = tier()
    fill(t, NS_A, PROMPT, 4)
    assert t.match(NS_A, PROMPT, 0, 10) == 4
    assert t.match(NS_A, PROMPT, 1, 10) == 3  # blocks 0 are the caller's (the pool's)
    assert t.match(NS_A, PROMPT, 0, 2) == 2
    other = list(PROMPT)
    other[9] += 1  # differs inside block 2
    assert t.match(NS_A, other, 0, 10) == 2
    assert t.load(NS_A, PROMPT, 1, 3) == [payload(1), payload(2), payload(3)]
    assert t.counters.num_loaded_blocks == 3


def test_namespaces_never_see_each_others_entries() -> None:
    t = tier()
    fill(t, NS_A, PROMPT, 4)
    assert t.match(NS_B, PROMPT, 0, 10) == 0
    assert t.load(NS_B, PROMPT, 0, 4) == []
    assert t.num_entries_in(NS_A) == 4 and t.num_entries_in(NS_B) == 0


def test_a_block_after_a_gap_is_not_matched() -> None:
    t = tier()
    t.add(NS_A, PROMPT[:4], payload(0))
    t.add(NS_A, PROMPT[:12], payload(2))  # block 1 is in neither place here
    assert t.match(NS_A, PROMPT, 0, 10) == 1


def test_an_entry_holding_another_namespaces_bytes_is_refused_and_dropped() -> None:
    store = MemoryTierStore()
    t = tier(store)
    t.add(NS_A, PROMPT[:4], payload(0))
    t.add(NS_B, PROMPT[:4], payload(9))
    # B's file put where A's belongs: valid bytes, wrong entry.
    store.put(entry_key(NS_A, PROMPT[:4]), store.get(entry_key(NS_B, PROMPT[:4])))
    assert t.load(NS_A, PROMPT, 0, 1) == []
    assert t.counters.num_refused == 1 and t.counters.num_checksum_failures == 0
    assert not t.contains(NS_A, PROMPT[:4]) and t.contains(NS_B, PROMPT[:4])


def test_a_load_stops_at_a_corrupt_entry_and_drops_it() -> None:
    store = MemoryTierStore()
    t = tier(store)
    fill(t, NS_A, PROMPT, 4)
    key = entry_key(NS_A, PROMPT[:12])
    data = bytearray(store.get(key))
    data[-10] ^= 0x10
    store.put(key, bytes(data))
    assert t.load(NS_A, PROMPT, 0, 4) == [payload(0), payload(1)]
    assert t.counters.num_checksum_failures == 1
    assert t.match(NS_A, PROMPT, 0, 4) == 2


def test_the_bytes_cap_drops_the_least_recently_used_entries() -> None:
    one = len(encode_entry(EntryHead("fp-1", NS_A, tuple(PROMPT[:4]), 64), payload(0)))
    t = tier(max_bytes=3 * one + 3 * 8 * 4)  # three entries (paths grow by 4 tokens each)
    fill(t, NS_A, PROMPT, 3)
    t.load(NS_A, PROMPT, 0, 1)  # block 0 is now the most recently used
    t.add(NS_A, PROMPT[:16], payload(3))
    assert t.num_bytes <= t.max_bytes
    assert t.contains(NS_A, PROMPT[:4]) and t.contains(NS_A, PROMPT[:16])
    assert not t.contains(NS_A, PROMPT[:8])
    assert t.counters.num_dropped >= 1


def test_a_namespace_cap_counts_pool_blocks_and_tier_entries_together() -> None:
    pool_blocks = {NS_A: 2, NS_B: 0}
    t = tier(max_blocks_per_namespace=3)
    t.set_pool_counter(lambda namespace: pool_blocks[namespace])
    fill(t, NS_A, PROMPT, 4)
    fill(t, NS_B, PROMPT, 3)
    assert t.num_entries_in(NS_A) == 1  # 2 in the pool + 1 in the tier
    assert t.contains(NS_A, PROMPT[:16])  # the newest kept
    assert t.num_entries_in(NS_B) == 3


def test_invalidate_drops_the_entry_and_every_entry_after_it() -> None:
    t = tier()
    fill(t, NS_A, PROMPT, 4)
    branch = [*PROMPT[:8], 1, 2, 3, 4]
    t.add(NS_A, branch, payload(7))
    assert t.invalidate(NS_A, PROMPT[:8]) == 4  # block 1, 2, 3 and the branch
    assert t.match(NS_A, PROMPT, 0, 4) == 1
    assert t.num_entries == 1


# -- file store ----------------------------------------------------------------------------------
def test_a_restart_indexes_the_directory_and_ignores_other_fingerprints(tmp_path: Path) -> None:
    t = tier(FileTierStore(tmp_path))
    fill(t, NS_A, PROMPT, 4)
    t.close()
    (tmp_path / ".tmp-123-abc").write_bytes(b"half an entry")
    (tmp_path / "not-its-name.kvb").write_bytes(
        (tmp_path / f"{entry_key(NS_A, PROMPT[:4])}.kvb").read_bytes()
    )
    again = tier(FileTierStore(tmp_path))
    assert again.restore() == 4
    assert again.counters.num_restored_at_start == 4
    assert again.counters.num_ignored_at_start == 1  # the misnamed copy
    assert not (tmp_path / ".tmp-123-abc").exists()
    assert again.load(NS_A, PROMPT, 0, 4) == [payload(i) for i in range(4)]
    again.close()
    other = KVTier(FileTierStore(tmp_path), "fp-2", BS, 1 << 20)
    assert other.restore() == 0
    assert other.counters.num_ignored_at_start == 4
    assert other.match(NS_A, PROMPT, 0, 4) == 0
    other.close()
    assert not list(tmp_path.glob("*.kvb"))  # removed: they could never be served here


def test_a_file_flipped_on_disk_after_a_restart_is_never_served(tmp_path: Path) -> None:
    t = tier(FileTierStore(tmp_path))
    fill(t, NS_A, PROMPT, 2)
    t.close()
    path = tmp_path / f"{entry_key(NS_A, PROMPT[:8])}.kvb"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # in the payload: the head still reads, the checksum fails
    path.write_bytes(bytes(data))
    again = tier(FileTierStore(tmp_path))
    again.restore()
    assert again.load(NS_A, PROMPT, 0, 2) == [payload(0)]
    assert again.counters.num_checksum_failures == 1
    again.close()
    assert not path.exists()


_WRITER = """
import sys
from engine.kv.kv_tier import KVTier
from engine.kv.tier_store import FileTierStore
t = KVTier(FileTierStore(sys.argv[1]), "fp-1", 4, 1 << 40)
size = 8 << 20
for i in range(10_000):
    t.add(("w0", "", ""), [i, i, i, i], bytes([i % 256]) * size)
    t.flush()
    print(i, flush=True)
"""


def test_kill_9_during_writes_leaves_no_entry_that_fails_or_is_half_written(tmp_path) -> None:
    root = Path(__file__).resolve().parents[3]
    process = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for _ in range(3):  # some entries published, the next ones under way
        assert process.stdout.readline()
    time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    t = tier(FileTierStore(tmp_path), max_bytes=1 << 40)
    num_restored = t.restore()
    assert num_restored >= 3
    for i in range(num_restored):
        loaded = t.load(("w0", "", ""), [i, i, i, i], 0, 1)
        assert loaded == [bytes([i % 256]) * (8 << 20)]
    assert t.counters.num_checksum_failures == 0 and t.counters.num_ignored_at_start == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    t.close()


def test_a_failed_write_leaves_no_file_and_keeps_no_bytes(tmp_path: Path, monkeypatch) -> None:
    store = FileTierStore(tmp_path)
    original = Path.write_bytes

    def disk_full(self, data):
        original(self, data[:10])  # a torn temporary file, then the error
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    store.put("k1", b"x" * 1000)
    store.flush()
    monkeypatch.setattr(Path, "write_bytes", original)
    assert store.num_write_errors == 1
    assert store.get("k1") is None  # neither in memory nor on disk
    assert list(tmp_path.iterdir()) == []
    store.put("k2", b"y" * 10)  # the writer goes on
    store.flush()
    assert store.get("k2") == b"y" * 10
    store.close()
    store.flush()  # closed: returns at once


def test_a_delete_is_on_disk_at_once(tmp_path: Path) -> None:
    store = FileTierStore(tmp_path)
    store.put("k1", b"x")
    store.flush()
    store.put("k2", b"y")  # possibly still queued
    store.delete("k1")
    store.delete("k2")
    assert store.get("k1") is None and store.get("k2") is None
    store.flush()
    assert list(tmp_path.iterdir()) == []
    store.close()


def test_a_writer_behind_refuses_new_entries_instead_of_growing(tmp_path, monkeypatch) -> None:
    gate = threading.Event()
    original = Path.write_bytes

    def slow_disk(self, data):
        assert gate.wait(timeout=10)
        return original(self, data)

    monkeypatch.setattr(Path, "write_bytes", slow_disk)
    t = KVTier(FileTierStore(tmp_path, max_pending_bytes=100), "fp-1", BS, 1 << 20)
    assert t.add(NS_A, PROMPT[:4], payload(0))  # nothing pending: taken however large
    assert not t.add(NS_A, PROMPT[:8], payload(1))  # the writer is behind: refused
    assert t.num_entries == 1 and t.store.num_write_errors == 1
    assert t.match(NS_A, PROMPT, 0, 4) == 1
    gate.set()
    t.flush()
    assert t.add(NS_A, PROMPT[:8], payload(1))  # written meanwhile: room again
    t.close()
    assert t.load(NS_A, PROMPT, 0, 2) == [payload(0), payload(1)]
