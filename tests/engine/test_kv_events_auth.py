"""KV events are an operator surface: with CURVE keys the publisher admits only the listed
subscribers and encrypts the events; without them, an endpoint reachable beyond the host is
refused unless kv_events_allow_plaintext says so.

Every socket here is on the loopback, and every wait is bounded (poll with a timeout).
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.auth

from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import EngineRequest
from engine.kv.kv_events import AllBlocksCleared
from engine.kv_event_publisher import KVEventPublisher
from tests.engine.engine_helpers import GREEDY, make_engine, random_prompts
from tests.integration.server import free_port

TOPIC = b"kvshare"
RECEIVE_TIMEOUT_S = 10.0  # for the authorised subscriber's first batch (ZMQ's slow joiner)
SILENCE_MS = 1000  # how long the refused subscribers are watched after the authorised one read


@dataclass(frozen=True)
class Certificates:
    """The server's certificate, the admitted clients' directory, and two client key files."""

    server_secret_file: str
    server_public_key: bytes
    clients_dir: str
    router_secret_file: str  # listed in clients_dir
    stranger_secret_file: str  # a valid key pair, not listed


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    made = {}
    for name in ("server", "router", "stranger"):
        (tmp_path / name).mkdir()
        made[name] = zmq.auth.create_certificates(tmp_path / name, name)  # (.key, .key_secret)
    clients_dir = tmp_path / "clients"
    clients_dir.mkdir()
    shutil.copy(made["router"][0], clients_dir)  # the operator lists the router's public key
    server_public_key, _ = zmq.auth.load_certificate(made["server"][0])
    return Certificates(
        server_secret_file=str(made["server"][1]),
        server_public_key=server_public_key,
        clients_dir=str(clients_dir),
        router_secret_file=str(made["router"][1]),
        stranger_secret_file=str(made["stranger"][1]),
    )


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(
    context: zmq.Context,
    endpoint: str,
    client_secret_file: str | None = None,
    server_public_key: bytes | None = None,
) -> zmq.Socket:
    """A SUB socket on the topic; a CURVE client when given its certificate and the server's key."""
    sub = context.socket(zmq.SUB)
    if client_secret_file is not None:
        sub.curve_publickey, sub.curve_secretkey = zmq.auth.load_certificate(client_secret_file)
        sub.curve_serverkey = server_public_key
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(endpoint)
    return sub


def publish_until_received(publisher: KVEventPublisher, sub: zmq.Socket) -> list:
    """Publish one-event batches until `sub` reads one (the subscription takes a moment to
    reach the PUB); returns that batch's decoded payload."""
    deadline = time.monotonic() + RECEIVE_TIMEOUT_S
    while time.monotonic() < deadline:
        publisher.publish([AllBlocksCleared()])
        if sub.poll(100):
            topic, _, payload = sub.recv_multipart()
            assert topic == TOPIC
            return msgpack.unpackb(payload)
    raise AssertionError(f"no KV event batch within {RECEIVE_TIMEOUT_S} s")


def curve_publisher(certificates: Certificates, endpoint: str) -> KVEventPublisher:
    return KVEventPublisher(
        endpoint,
        curve_secret_key_file=certificates.server_secret_file,
        curve_clients_dir=certificates.clients_dir,
    )


def test_an_authorised_subscriber_receives_the_events(certificates, context) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = curve_publisher(certificates, endpoint)
    try:
        router = subscribe(
            context, endpoint, certificates.router_secret_file, certificates.server_public_key
        )
        _, events, _ = publish_until_received(publisher, router)
        assert events == [["AllBlocksCleared"]]
    finally:
        publisher.close()


def test_unlisted_and_plaintext_subscribers_receive_nothing(certificates, context) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = curve_publisher(certificates, endpoint)
    try:
        key = certificates.server_public_key
        stranger = subscribe(context, endpoint, certificates.stranger_secret_file, key)
        plaintext = subscribe(context, endpoint)
        router = subscribe(context, endpoint, certificates.router_secret_file, key)
        publish_until_received(publisher, router)
        for _ in range(5):  # more batches, once the router is known to be served
            publisher.publish([AllBlocksCleared()])
        assert router.poll(SILENCE_MS)
        assert not stranger.poll(SILENCE_MS)
        assert not plaintext.poll(0)
    finally:
        publisher.close()


def test_the_wire_speaks_curve_not_plain_text(certificates) -> None:
    """A raw TCP peer reads the server's ZMTP 3 greeting: its mechanism field (bytes 12..31)
    is CURVE (encrypted frames), not NULL (the frames as they are)."""
    port = free_port()
    publisher = curve_publisher(certificates, f"tcp://127.0.0.1:{port}")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5.0) as peer:
            peer.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03")  # signature, version 3
            greeting = b""
            while len(greeting) < 64 and (chunk := peer.recv(64 - len(greeting))):
                greeting += chunk
    finally:
        publisher.close()
    assert greeting[12:32].rstrip(b"\0") == b"CURVE"


def test_an_engine_with_curve_keys_publishes_only_to_listed_subscribers(
    tiny_model_dir, certificates, context
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = make_engine(
        tiny_model_dir,
        kv_events_endpoint=endpoint,
        kv_events_curve_secret_key_file=certificates.server_secret_file,
        kv_events_curve_clients_dir=certificates.clients_dir,
    )
    try:
        key = certificates.server_public_key
        plaintext = subscribe(context, endpoint)
        router = subscribe(context, endpoint, certificates.router_secret_file, key)
        publish_until_received(engine.kv_event_publisher, router)
        for i, prompt in enumerate(random_prompts(2, seed=7, min_len=40)):
            engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
            while engine.has_unfinished_requests():
                engine.step()
        assert "BlockStored" in received_event_kinds(router)
        assert not plaintext.poll(0)
    finally:
        engine.close()


def received_event_kinds(sub: zmq.Socket) -> set[str]:
    """The kinds of every event that reaches `sub` until none has for SILENCE_MS."""
    kinds = set()
    while sub.poll(SILENCE_MS):
        _, _, payload = sub.recv_multipart()
        kinds.update(event[0] for event in msgpack.unpackb(payload)[1])
    return kinds


# -- the guard -------------------------------------------------------------------------------
BEYOND_THE_HOST = ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://10.1.2.3:5557"]
HOST_LOCAL = ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///tmp/k"]


@pytest.mark.parametrize("endpoint", BEYOND_THE_HOST)
def test_the_guard_refuses_an_endpoint_beyond_the_host_without_curve(endpoint: str) -> None:
    with pytest.raises(ParamError) as refused:
        EngineConfig(kv_events_endpoint=endpoint)
    assert refused.value.param == "kv_events_endpoint"
    for fix in ("kv_events_curve_secret_key_file", "loopback", "kv_events_allow_plaintext"):
        assert fix in refused.value.message


@pytest.mark.parametrize("endpoint", BEYOND_THE_HOST)
def test_the_guard_accepts_an_endpoint_beyond_the_host_with_the_opt_out(endpoint: str) -> None:
    config = EngineConfig(kv_events_endpoint=endpoint, kv_events_allow_plaintext=True)
    assert config.kv_events_endpoint == endpoint


def test_the_guard_accepts_an_endpoint_beyond_the_host_with_curve(certificates) -> None:
    config = EngineConfig(
        kv_events_endpoint="tcp://0.0.0.0:5557",
        kv_events_curve_secret_key_file=certificates.server_secret_file,
        kv_events_curve_clients_dir=certificates.clients_dir,
    )
    assert config.kv_events_allow_plaintext is False


@pytest.mark.parametrize("endpoint", HOST_LOCAL)
def test_the_guard_accepts_a_host_local_endpoint_without_curve_or_opt_out(endpoint: str) -> None:
    config = EngineConfig(kv_events_endpoint=endpoint, kv_events_allow_plaintext=False)
    assert config.kv_events_curve_secret_key_file is None


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ("kv_events_curve_secret_key_file", "kv_events_curve_clients_dir"),
        ("kv_events_curve_clients_dir", "kv_events_curve_secret_key_file"),
    ],
)
def test_one_curve_key_without_the_other_names_the_missing_one(
    certificates, given: str, missing: str
) -> None:
    value = {
        "kv_events_curve_secret_key_file": certificates.server_secret_file,
        "kv_events_curve_clients_dir": certificates.clients_dir,
    }[given]
    with pytest.raises(ParamError) as refused:
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", **{given: value})
    assert refused.value.param == missing


def test_a_public_certificate_in_place_of_the_secret_one_fails_at_start(certificates) -> None:
    public_file = certificates.server_secret_file.removesuffix("_secret")
    with pytest.raises(ParamError) as refused:
        KVEventPublisher(
            f"tcp://127.0.0.1:{free_port()}",
            curve_secret_key_file=public_file,
            curve_clients_dir=certificates.clients_dir,
        )
    assert refused.value.param == "kv_events_curve_secret_key_file"
    assert ".key_secret" in refused.value.message
