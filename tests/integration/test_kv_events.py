"""KV events of a real `kvshare serve` (SmolLM2, config/cpu.yaml, a small KV pool).

A ZMQ subscriber rebuilds the set of cached block hashes from the events while a workload
inserts shared prefixes, evicts (more distinct prompts than the pool holds) and quarantines
(a drilled corruption caught by the audit); the set must equal the server's own listing
(GET /debug/kv_blocks), with no sequence gap and nothing dropped. `kvshare serve` refuses to
publish in plain text on an endpoint reachable beyond the host (the CURVE side:
tests/engine/test_kv_events_auth.py).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import msgpack
import pytest
import zmq

from app.cli import build_parser
from app.settings import flag_overrides, load_settings
from tests.integration.server import REPO, free_port, running_server, scrape

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 40  # 640 tokens: the distinct prompts below need more, so the cache evicts
MAX_TOKENS = 4
TOPIC = b"kvtest"


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [1000 + 100 * seed] + [rng.randrange(1000, 40000) for _ in range(length - 1)]


@dataclass
class Subscriber:
    """Applies KV event batches in sequence order to a set of block hashes."""

    socket: zmq.Socket
    held: set[int] = field(default_factory=set)
    seqs: list[int] = field(default_factory=list)
    num_events: int = 0
    num_stored: int = 0
    num_removed: int = 0
    num_cleared: int = 0

    def drain(self, timeout_ms: int = 200) -> int:
        """Apply every batch that arrives until none has for timeout_ms; returns how many."""
        num_batches = 0
        while self.socket.poll(timeout_ms):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(msgpack.unpackb(payload))
            num_batches += 1
        return num_batches

    def apply(self, batch: list) -> None:
        ts, events, data_parallel_rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 600
        assert data_parallel_rank is None
        for event in events:
            self.num_events += 1
            if event[0] == "BlockStored":
                _, hashes, parent, token_ids, block_size, lora_id, medium = event
                assert (block_size, lora_id, medium) == (BLOCK_SIZE, None, "GPU")
                assert len(token_ids) == BLOCK_SIZE * len(hashes)
                assert parent is None or parent in self.held, "stored under an unknown parent"
                assert not self.held & set(hashes), "a block stored twice"
                self.held.update(hashes)
                self.num_stored += len(hashes)
            elif event[0] == "BlockRemoved":
                _, hashes, medium = event
                assert medium == "GPU"
                assert set(hashes) <= self.held, "removed a block never stored"
                self.held.difference_update(hashes)
                self.num_removed += len(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.held.clear()
                self.num_cleared += 1


@pytest.fixture(scope="module")
def kv_events_server() -> Iterator[tuple[str, str]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    flags = (
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--audit-sample-rate", "1.0",
        "--audit-max-pending", "16",
        "--enable-fault-injection",
        "--kv-events-endpoint", endpoint,
        "--kv-events-topic", TOPIC.decode(),
    )  # fmt: skip
    with running_server(*flags) as url:
        yield url, endpoint


@pytest.fixture
def subscriber(kv_events_server) -> Iterator[Subscriber]:
    _, endpoint = kv_events_server
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)  # keep every batch until the test reads it
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(endpoint)
    time.sleep(1.0)  # ZMQ's slow joiner: the subscription must reach the PUB before events
    try:
        yield Subscriber(socket)
    finally:
        socket.close(linger=0)
        context.term()


def ask(http: httpx.Client, prompt: list[int], salt: str | None = None) -> int:
    """A greedy completion; returns its cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for(base_url: str, name: str, value: float, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (metrics := scrape(base_url))[name] < value:
        assert time.monotonic() < deadline, (name, metrics[name], value)
        time.sleep(0.2)
    return metrics


def listing(http: httpx.Client) -> list[int]:
    response = http.get("/debug/kv_blocks")
    assert response.status_code == 200, response.text
    return response.json()["block_hashes"]


def test_subscriber_rebuilds_the_servers_cached_blocks(kv_events_server, subscriber) -> None:
    base_url, _ = kv_events_server
    http = httpx.Client(base_url=base_url, timeout=120.0)
    # Inserts and hits: three prompts sharing a 48-token prefix, in two namespaces.
    shared = ids(1, 48)
    for salt in ("a", "b"):
        for tail in range(3):
            ask(http, shared + ids(10 + tail, 20), salt)
    assert ask(http, shared + ids(10, 20), "a") > 0
    # Evictions: distinct prompts of 6 blocks each, 12 of them, in a pool of 40 blocks.
    for seed in range(20, 32):
        ask(http, ids(seed, 96))
    metrics = scrape(base_url)
    assert metrics["kvshare_kv_evictions_total"] > 0
    # Quarantine: cache a prompt, corrupt its first block, hit it: the audit drops 3 blocks.
    before = metrics["kvshare_cache_quarantined_blocks_total"]
    prompt = ids(6, 48)
    ask(http, prompt, "drill")
    drill = http.post("/debug/faults", json={"kind": "corrupt_block"})
    assert drill.status_code == 200, drill.text
    assert ask(http, prompt, "drill") == 47
    wait_for(base_url, "kvshare_cache_quarantined_blocks_total", before + 3)
    ask(http, ids(40, 40))  # one more insert after the quarantine

    # Idle: the listing queues the last events; read until the published count is reached.
    expected = listing(http)
    deadline = time.monotonic() + 30.0
    while True:
        subscriber.drain()
        metrics = scrape(base_url)
        if subscriber.num_events >= metrics["kvshare_kv_events_published_total"]:
            break
        assert time.monotonic() < deadline, (subscriber.num_events, metrics)
    subscriber.drain(500)

    assert subscriber.seqs == list(range(len(subscriber.seqs))), "a gap in the sequence"
    assert subscriber.held == set(expected)
    assert sorted(expected) == expected and len(expected) == len(set(expected))
    assert listing(http) == expected  # the engine was idle: nothing changed since
    metrics = scrape(base_url)
    assert metrics["kvshare_kv_events_dropped_total"] == 0
    assert metrics["kvshare_kv_events_published_total"] == subscriber.num_events
    assert metrics["kvshare_cache_write_violations_total"] == 0
    # Every removal was an eviction or a quarantine, and both happened.
    evicted = metrics["kvshare_kv_evictions_total"]
    quarantined = metrics["kvshare_cache_quarantined_blocks_total"]
    assert evicted > 0 and quarantined >= 3
    assert subscriber.num_removed == evicted + quarantined
    assert subscriber.num_stored - subscriber.num_removed == len(expected)
    assert metrics["kvshare_kv_blocks_leaked"] == 0


def test_kv_blocks_listing_is_404_without_kv_events(server_url: str) -> None:
    response = httpx.get(f"{server_url}/debug/kv_blocks", timeout=30.0)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_events_disabled" and "kv-events-endpoint" in error["message"]
    assert scrape(server_url)["kvshare_kv_events_published_total"] == 0


def test_serve_refuses_a_wildcard_endpoint_without_curve_or_opt_out(tmp_path) -> None:
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(free_port())]
    command += ["--model", str(tmp_path / "never-loaded")]  # the settings are refused first
    command += ["--kv-events-endpoint", f"tcp://*:{free_port()}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kv_events_endpoint is reachable beyond this host" in done.stderr
    assert "kv_events_allow_plaintext" in done.stderr


def test_serve_flags_set_the_curve_keys_and_the_opt_out(tmp_path) -> None:
    secret_key_file = tmp_path / "server.key_secret"
    secret_key_file.write_text("")  # it must exist; only the publisher reads it

    def engine_settings(*flags: str):
        args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://*:5557", *flags])
        return load_settings("config/cpu.yaml", {}, flag_overrides(args)).engine

    curve = engine_settings(
        "--kv-events-curve-secret-key-file", str(secret_key_file),
        "--kv-events-curve-clients-dir", str(tmp_path),
    )  # fmt: skip
    assert curve.kv_events_curve_secret_key_file == str(secret_key_file)
    assert curve.kv_events_curve_clients_dir == str(tmp_path)
    assert engine_settings("--kv-events-allow-plaintext").kv_events_allow_plaintext is True
