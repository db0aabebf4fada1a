"""The grammar compile host: a process that compiles each grammar in a forked child, so a
compile past its time limit is killed with its child instead of running on.

Run as a script by engine/runtime/grammar_compiles.py (it imports nothing of kvshare). It
imports xgrammar once; every compile then costs a fork, not an interpreter start. The host
itself never compiles (xgrammar's compile threads would not survive a fork).

Wire, both ways: frames of a 4-byte big-endian length and a JSON list.
  in:  ["tokenizer", tokenizer_id, tokenizer_info_json]   register a vocabulary
       ["forget", tokenizer_id]
       ["compile", job_id, tokenizer_id, kind, text, timeout_s]   kind: "json_schema" or
                                                            "structural_tag"
       ["cancel", job_id]                                   kill it; no answer is sent
  out: ["done", job_id, compiled_grammar_json, seconds]
       ["error", job_id, message]
       ["timeout", job_id]
The host exits when its stdin closes, killing the children it still has.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import struct
import sys
import time
from dataclasses import dataclass, field

import xgrammar as xgr

_HEADER = struct.Struct(">I")


@dataclass
class _Child:
    job_id: int
    pid: int
    pipe_fd: int  # the read end of the child's result pipe
    deadline: float  # time.monotonic()
    received: bytearray = field(default_factory=bytearray)


def read_exactly(fd: int, num_bytes: int) -> bytes:
    """num_bytes from a blocking fd; fewer only at its end."""
    data = bytearray()
    while len(data) < num_bytes:
        chunk = os.read(fd, num_bytes - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def read_frame(fd: int) -> list | None:
    """The next frame from a blocking fd (unbuffered, so select() sees what is left); None
    at its end."""
    header = read_exactly(fd, _HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = read_exactly(fd, size)
    return json.loads(payload) if len(payload) == size else None


def write_frame(fd: int, message: list) -> None:
    payload = json.dumps(message).encode()
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def compile_in_child(info: xgr.TokenizerInfo, kind: str, text: str) -> list:
    """What the child sends back: ["ok", json, seconds] or ["error", message]."""
    started = time.perf_counter()
    try:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        if kind == "structural_tag":
            compiled = compiler.compile_structural_tag(text)
        else:
            # any_whitespace=False: whitespace between tokens is bounded, so output terminates.
            compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        return ["ok", compiled.serialize_json(), time.perf_counter() - started]
    except Exception as exc:  # the schema's fault, reported to its request
        return ["error", str(exc) or type(exc).__name__]


class Host:
    def __init__(self, stdin: int, stdout: int) -> None:
        self.stdin, self.stdout = stdin, stdout
        self.tokenizers: dict[int, xgr.TokenizerInfo] = {}
        self.children: dict[int, _Child] = {}  # by pipe fd
        self.selector = selectors.DefaultSelector()
        self.selector.register(stdin, selectors.EVENT_READ)

    def run(self) -> None:
        try:
            while self._serve_once():
                pass
        finally:
            for child in list(self.children.values()):
                self._kill(child)

    def _serve_once(self) -> bool:
        for key, _ in self.selector.select(self._seconds_to_next_deadline()):
            if key.fileobj is self.stdin:
                message = read_frame(self.stdin)
                if message is None:
                    return False
                self._handle(message)
            else:
                self._read_child(self.children[key.fileobj])
        self._expire(time.monotonic())
        return True

    def _seconds_to_next_deadline(self) -> float | None:
        if not self.children:
            return None
        return max(0.0, min(child.deadline for child in self.children.values()) - time.monotonic())

    def _handle(self, message: list) -> None:
        verb = message[0]
        if verb == "tokenizer":
            self.tokenizers[message[1]] = xgr.TokenizerInfo.deserialize_json(message[2])
        elif verb == "forget":
            self.tokenizers.pop(message[1], None)
        elif verb == "compile":
            self._start(*message[1:])
        elif verb == "cancel":
            for child in list(self.children.values()):
                if child.job_id == message[1]:
                    self._kill(child)

    def _start(
        self, job_id: int, tokenizer_id: int, kind: str, text: str, timeout_s: float
    ) -> None:
        info = self.tokenizers.get(tokenizer_id)
        if info is None:
            write_frame(self.stdout, ["error", job_id, "the tokenizer is not registered"])
            return
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compile, answer, leave without running the host's cleanup
            os.close(read_fd)
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(json.dumps(compile_in_child(info, kind, text)).encode())
            os._exit(0)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        child = _Child(job_id, pid, read_fd, time.monotonic() + timeout_s)
        self.children[read_fd] = child
        self.selector.register(read_fd, selectors.EVENT_READ)

    def _read_child(self, child: _Child) -> None:
        try:
            chunk = os.read(child.pipe_fd, 1 << 20)
        except BlockingIOError:
            return
        if chunk:
            child.received += chunk
            return
        self._reap(child)
        try:
            answer = json.loads(bytes(child.received))
        except Exception:
            answer = ["error", "the compile process ended without an answer"]
        if answer[0] == "ok":
            write_frame(self.stdout, ["done", child.job_id, answer[1], answer[2]])
        else:
            write_frame(self.stdout, ["error", child.job_id, answer[1]])

    def _expire(self, now: float) -> None:
        for child in list(self.children.values()):
            if child.deadline <= now:
                self._kill(child)
                write_frame(self.stdout, ["timeout", child.job_id])

    def _kill(self, child: _Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        self._reap(child)

    def _reap(self, child: _Child) -> None:
        self.selector.unregister(child.pipe_fd)
        os.close(child.pipe_fd)
        del self.children[child.pipe_fd]
        os.waitpid(child.pid, 0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    frames_out = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print never splits a frame
    Host(sys.stdin.fileno(), frames_out).run()
