"""Grammar compiles, bounded: two at once for the whole process, one per tenant, tenants taking
turns, and each one killed at its time limit.

The compiles run in engine/runtime/grammar_host.py, a process of its own that forks a child
per compile: a thread cannot be stopped, a child can, so a schema that compiles for minutes
holds a worker for its time limit only. The host starts with the first registered tokenizer
(outside any request's time limit) and again after it dies.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xgrammar as xgr

from engine.runtime.grammar_host import read_frame, write_frame

logger = logging.getLogger(__name__)

NUM_WORKERS = 2  # compiles at once, all tenants together
NUM_PER_TENANT = 1  # so one tenant's slow schemas never hold every worker
_HOST_SCRIPT = Path(__file__).with_name("grammar_host.py")

Compiled = tuple[xgr.CompiledGrammar, float]  # the grammar, and seconds its compile took


class CompileTimeout(Exception):
    """The compile did not finish within its time limit (it was killed, or never started)."""


class CompileFailed(Exception):
    """The grammar engine refused the grammar; the message is its own."""


@dataclass
class _Job:
    job_id: int
    tenant: str | None
    tokenizer_id: int
    kind: str  # "json_schema" or "structural_tag"
    text: str
    deadline: float  # time.monotonic()
    future: Future[Compiled]


class GrammarCompiles:
    """The compile host and the fair queue in front of it. Thread-safe: any thread may
    register a tokenizer, submit a compile and give up on one; a reader thread resolves the
    futures."""

    def __init__(self, num_workers: int = NUM_WORKERS, num_per_tenant: int = NUM_PER_TENANT):
        self.num_workers = num_workers
        self.num_per_tenant = num_per_tenant
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._tokenizers: dict[int, xgr.TokenizerInfo] = {}
        self._queues: OrderedDict[str | None, deque[_Job]] = OrderedDict()  # turn order
        self._running: dict[int, _Job] = {}  # sent to the host, by job id
        self._host: subprocess.Popen | None = None

    def register(self, info: xgr.TokenizerInfo) -> int:
        """An id for compiles against `info`; starts the host if it is not running."""
        with self._lock:
            tokenizer_id = next(self._ids)
            self._tokenizers[tokenizer_id] = info
            host = self._host_locked()
            write_frame(host.stdin.fileno(), ["tokenizer", tokenizer_id, info.serialize_json()])
        return tokenizer_id

    def forget(self, tokenizer_id: int) -> None:
        with self._lock:
            if self._tokenizers.pop(tokenizer_id, None) is not None and self._is_host_alive():
                self._send_locked(["forget", tokenizer_id])

    def submit(
        self, tokenizer_id: int, tenant: str | None, kind: str, text: str, timeout_s: float
    ) -> Future[Compiled]:
        """The compile's future: (grammar, seconds), or CompileTimeout / CompileFailed. Its
        time limit counts from now, waiting for a worker included."""
        job = _Job(
            next(self._ids), tenant, tokenizer_id, kind, text,
            time.monotonic() + timeout_s, Future(),
        )  # fmt: skip
        with self._lock:
            self._queues.setdefault(tenant, deque()).append(job)
        self._dispatch()
        return job.future

    def give_up(self, future: Future[Compiled]) -> None:
        """Nobody waits for `future` any more: drop it from the queue, or kill its compile."""
        if future.cancel():  # still queued: skipped when its turn comes
            return
        with self._lock:
            job = next((job for job in self._running.values() if job.future is future), None)
            if job is None:
                return
            self._send_locked(["cancel", job.job_id])
            del self._running[job.job_id]
        future.set_exception(CompileTimeout())
        self._dispatch()

    def close(self) -> None:
        """Stop the host (its children are killed); queued and running compiles time out."""
        with self._lock:
            host, self._host = self._host, None
            running = list(self._running.values())
            queued = [job for queue in self._queues.values() for job in queue]
            self._running.clear()
            self._queues.clear()
        if host is not None:
            host.stdin.close()
            host.wait()
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompileTimeout())
        for job in running:
            if not job.future.done():
                job.future.set_exception(CompileTimeout())

    # -- the queue (futures are resolved outside the lock: their callbacks take others) ----
    def _dispatch(self) -> None:
        """Send queued compiles while a worker is free: the next tenant in turn that holds
        fewer than num_per_tenant workers; an expired compile times out without running."""
        expired = []
        with self._lock:
            while len(self._running) < self.num_workers:
                job = self._next_job_locked()
                if job is None:
                    break
                if not job.future.set_running_or_notify_cancel():
                    continue  # its waiter gave up
                remaining = job.deadline - time.monotonic()
                if remaining <= 0:
                    expired.append(job)
                    continue
                self._running[job.job_id] = job
                message = ["compile", job.job_id, job.tokenizer_id, job.kind, job.text, remaining]
                self._send_locked(message)
        for job in expired:
            job.future.set_exception(CompileTimeout())

    def _next_job_locked(self) -> _Job | None:
        num_by_tenant: dict[str | None, int] = {}
        for job in self._running.values():
            num_by_tenant[job.tenant] = num_by_tenant.get(job.tenant, 0) + 1
        for tenant, queue in self._queues.items():
            if num_by_tenant.get(tenant, 0) >= self.num_per_tenant:
                continue
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(tenant)  # the others' turn first
            else:
                del self._queues[tenant]
            return job
        return None

    # -- the host ----------------------------------------------------------------------
    def _host_locked(self) -> subprocess.Popen:
        if self._is_host_alive():
            return self._host
        host = subprocess.Popen(
            [sys.executable, str(_HOST_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C is for the server, which stops it
        )
        self._host = host
        for tokenizer_id, info in self._tokenizers.items():
            write_frame(host.stdin.fileno(), ["tokenizer", tokenizer_id, info.serialize_json()])
        reader = threading.Thread(
            target=self._read_answers, args=(host,), name="kvshare-grammar-host", daemon=True
        )
        reader.start()
        return host

    def _is_host_alive(self) -> bool:
        return self._host is not None and self._host.poll() is None

    def _send_locked(self, message: list) -> None:
        try:
            write_frame(self._host_locked().stdin.fileno(), message)
        except OSError:  # it died just now: its reader fails what it was running
            logger.warning("the grammar compile host stopped; it restarts with the next compile")

    def _read_answers(self, host: subprocess.Popen) -> None:
        fd = host.stdout.fileno()
        while (message := read_frame(fd)) is not None:
            self._resolve(message)
        self._lost(host)

    def _resolve(self, message: list) -> None:
        verb, job_id = message[0], message[1]
        with self._lock:
            job = self._running.pop(job_id, None)
            if job is None:
                return  # given up on
            info = self._tokenizers.get(job.tokenizer_id)
        self._dispatch()
        if verb == "done" and info is not None:
            compiled = xgr.CompiledGrammar.deserialize_json(message[2], info)
            job.future.set_result((compiled, message[3]))
        elif verb == "timeout":
            job.future.set_exception(CompileTimeout())
        else:
            text = message[2] if verb == "error" else "the tokenizer was closed"
            job.future.set_exception(CompileFailed(text))

    def _lost(self, host: subprocess.Popen) -> None:
        """The host ended: what it was running fails; the next compile starts a new one."""
        with self._lock:
            if self._host is not host:
                return  # closed on purpose
            self._host = None
            jobs = list(self._running.values())
            self._running.clear()
        host.wait()
        logger.warning("the grammar compile host exited (status %s)", host.returncode)
        for job in jobs:
            job.future.set_exception(CompileFailed("the grammar compile process stopped"))
        self._dispatch()


_shared: GrammarCompiles | None = None
_shared_lock = threading.Lock()


def shared_compiles() -> GrammarCompiles:
    """The process's one GrammarCompiles: every engine in it shares the workers."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarCompiles()
        return _shared
