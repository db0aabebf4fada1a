"""Publishes the prefix cache's KV events over ZMQ in vLLM's wire format (opt-in).

Off unless the engine key kv_events_endpoint is set. The engine thread never waits on the
network: at the end of a step it hands that step's events (plain records from
engine/kv/kv_events.py) to publish(), which only puts them on a bounded queue; a publisher
thread owns the ZMQ socket, encodes and sends. A batch that finds the queue full is dropped
and its events counted (num_dropped_events -> kvshare_kv_events_dropped_total).

Wire format (vLLM's ZMQ KV events, vllm/distributed/kv_events.py, positional-array form read by
NVIDIA Dynamo's ZMQ relay and llm-d's kv-cache indexer):

  socket   PUB, bound at kv_events_endpoint (e.g. tcp://127.0.0.1:5557 or tcp://*:5557);
           subscribers connect and subscribe to the topic. kvshare always binds (vLLM binds
           only wildcard / ipc / inproc endpoints). There is no replay socket.
  access   with kv_events_curve_secret_key_file and kv_events_curve_clients_dir set, the
           socket is a CURVE server: a ZAP handler on the publisher's context admits only the
           subscribers whose public certificates lie in the clients directory (read at start),
           and the events are encrypted. Without them, the frames below travel in plain text
           (engine/core/config.py refuses that on an endpoint reachable beyond the host
           unless kv_events_allow_plaintext is set).
  message  multipart [topic (UTF-8 bytes), seq (8 bytes, big-endian unsigned), payload]
           seq counts batches from 0 per publisher. It is taken when a batch is queued, so a
           batch dropped on a full queue shows as a gap in seq.
  payload  msgpack EventBatch: [ts, events, data_parallel_rank]
           ts: float seconds since the epoch (when the step ended); data_parallel_rank: nil.
  events   tagged arrays, in the order the cache changed:
           ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
            medium]
           ["BlockRemoved", block_hashes, medium]
           ["AllBlocksCleared"]
           block hashes are unsigned 64-bit ints (engine/kv/kv_events.py: SHA-256 chained over
           full blocks, the namespace folded into the first); parent_block_hash is nil for a
           chain starting at position 0; token_ids are block_size ids per stored block;
           lora_id is nil (adapters are part of the namespace, hence of the hashes); medium is
           "GPU", vLLM's name for the primary KV pool (also when kvshare runs on CPU: routers
           read "CPU" as an offload tier).

Newer vLLM versions send each event as a map with named fields; this module sends the
positional arrays above (the form routers have long decoded).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from engine.core.errors import ParamError
from engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
_POLL_S = 0.1
_START_TIMEOUT_S = 10.0
_LINGER_MS = 500  # at close: time for queued messages to leave the socket


def event_to_wire(event: KVEvent) -> list[Any]:
    """One event as vLLM's tagged array (see the module docstring)."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id
            MEDIUM,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), MEDIUM]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload of one EventBatch."""
    return msgpack.packb([ts, [event_to_wire(e) for e in events], data_parallel_rank])


@dataclass(frozen=True)
class CurveServerKeys:
    """The PUB socket's CURVE key pair (Z85 text) and where its admitted clients' keys lie."""

    public_key: bytes
    secret_key: bytes
    clients_dir: str


def load_curve_server_keys(secret_key_file: str, clients_dir: str) -> CurveServerKeys:
    """Read the server's certificate and check the clients directory; a bad one raises
    ParamError naming its config key, at startup rather than on a subscriber's first try."""
    clients_path = Path(clients_dir).expanduser()
    try:
        public_key, secret_key = zmq.auth.load_certificate(Path(secret_key_file).expanduser())
    except (OSError, ValueError) as exc:
        message = f"cannot read the certificate {secret_key_file}: {exc}"
        raise ParamError("kv_events_curve_secret_key_file", message) from exc
    if secret_key is None or not (_is_curve_key(public_key) and _is_curve_key(secret_key)):
        message = (
            f"{secret_key_file} holds no CURVE key pair: give the .key_secret file "
            "that zmq.auth.create_certificates writes"
        )
        raise ParamError("kv_events_curve_secret_key_file", message)
    try:
        num_clients = len(zmq.auth.load_certificates(clients_path))
    except (OSError, ValueError) as exc:
        message = f"cannot read the certificates in {clients_dir}: {exc}"
        raise ParamError("kv_events_curve_clients_dir", message) from exc
    if num_clients == 0:
        message = f"{clients_dir} holds no public certificate (*.key): no subscriber could connect"
        raise ParamError("kv_events_curve_clients_dir", message)
    logger.info("KV events are encrypted (CURVE) for %d subscriber keys", num_clients)
    return CurveServerKeys(public_key, secret_key, str(clients_path))


def _is_curve_key(key: bytes) -> bool:
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


class KVEventPublisher:
    """A PUB socket and the thread that feeds it from a bounded queue of event batches.

    publish() is for the engine thread and never blocks; close() stops the thread after it
    has sent what is queued. num_published_events (written by the publisher thread) and
    num_dropped_events (by the engine thread) only grow; reading them from another thread is
    safe (a plain int).

    With curve_secret_key_file and curve_clients_dir (both or neither), the socket is a CURVE
    server that admits only the clients whose certificates lie in that directory.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kvshare",
        queue_size: int = 10_000,
        curve_secret_key_file: str | None = None,
        curve_clients_dir: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._curve = self._load_curve(curve_secret_key_file, curve_clients_dir)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, float, list[KVEvent]] | None] = queue.Queue(
            maxsize=queue_size
        )
        self._next_seq = 0
        self.num_published_events = 0
        self.num_dropped_events = 0
        self._stop = False  # set when close() could not queue its end marker
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kvshare-kv-events", daemon=True)
        self._thread.start()
        self._wait_bound()

    @staticmethod
    def _load_curve(secret_key_file: str | None, clients_dir: str | None) -> CurveServerKeys | None:
        if bool(secret_key_file) != bool(clients_dir):
            missing = "curve_clients_dir" if secret_key_file else "curve_secret_key_file"
            raise ParamError(f"kv_events_{missing}", f"kv_events_{missing} must be set too")
        if not secret_key_file or not clients_dir:
            return None
        return load_curve_server_keys(secret_key_file, clients_dir)

    def _wait_bound(self) -> None:
        """The thread binds the socket (it owns it); a bad endpoint fails here, at startup."""
        if not self._started.wait(_START_TIMEOUT_S):
            raise RuntimeError(f"the KV event publisher did not start on {self.endpoint}")
        if self._start_error is not None:
            self._thread.join()
            message = f"cannot bind the KV event socket at {self.endpoint!r}: {self._start_error}"
            raise ParamError("kv_events_endpoint", message) from self._start_error

    # -- engine thread --------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (one engine step's events); dropped and counted if the queue is full."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped_events += len(events)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the socket. Safe to call again."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV event queue still full at close; stopping without draining it")
            self._stop = True
        self._thread.join(timeout_s)

    # -- publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        authenticator = None
        try:
            if self._curve is not None:  # the ZAP handler must run before the first connect
                authenticator = _start_authenticator(context, self._curve)
                _make_curve_server(socket, self._curve)
            socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._start_error = exc
            _close(context, socket, authenticator, linger_ms=0)
            self._started.set()
            return
        self._started.set()
        try:
            self._send_until_closed(socket)
        finally:
            _close(context, socket, authenticator, linger_ms=_LINGER_MS)

    def _send_until_closed(self, socket: zmq.Socket) -> None:
        while not self._stop:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(ts, events)
                socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            except Exception:  # never let one bad batch stop the stream
                logger.exception("failed to publish KV event batch %d", seq)
                continue
            self.num_published_events += len(events)


def _start_authenticator(context: zmq.Context, curve: CurveServerKeys) -> ThreadAuthenticator:
    """A ZAP handler on `context` that admits only the clients in curve.clients_dir."""
    authenticator = ThreadAuthenticator(context, log=logger.getChild("zap"))
    authenticator.start()
    authenticator.configure_curve(domain="*", location=curve.clients_dir)
    return authenticator


def _make_curve_server(socket: zmq.Socket, curve: CurveServerKeys) -> None:
    socket.curve_secretkey = curve.secret_key
    socket.curve_publickey = curve.public_key
    socket.curve_server = True


def _close(
    context: zmq.Context,
    socket: zmq.Socket,
    authenticator: ThreadAuthenticator | None,
    linger_ms: int,
) -> None:
    socket.close(linger=linger_ms)
    if authenticator is not None:
        authenticator.stop()
    context.term()
