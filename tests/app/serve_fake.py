"""Run `kvshare serve`'s server over the FakeEngine (for the SIGTERM test, in a subprocess).

Usage: python serve_fake.py TOKENIZER_DIR STEP_DELAY_S [SHUTDOWN_GRACE_S (30)]
Prints the port it listens on, then serves until signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from fake_engine import FakeEngine

from app.server import build_server, create_app
from app.settings import ServerSettings, Settings


def spawn(tokenizer_dir: Path, *args: object) -> tuple[subprocess.Popen, str]:
    """Start this script in a child process (args: STEP_DELAY_S [SHUTDOWN_GRACE_S]); return
    the child and its base URL once it has printed its port."""
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here.parents[2])])}
    command = [sys.executable, str(here), str(tokenizer_dir), *(str(a) for a in args)]
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    return child, f"http://127.0.0.1:{child.stdout.readline().strip()}"


@contextlib.contextmanager
def ready_child(tokenizer_dir: Path, *args: object, timeout_s: float) -> Iterator[tuple]:
    """spawn(), wait until /ready says 200, yield (child, base URL); kill the child after if
    it is still running."""
    child, url = spawn(tokenizer_dir, *args)
    try:
        deadline = time.monotonic() + timeout_s
        while not _is_ready(url):
            if time.monotonic() > deadline:
                raise TimeoutError("the child server did not become ready")
            time.sleep(0.05)
        yield child, url
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def sigterm_mid_stream(
    child: subprocess.Popen,
    url: str,
    body: dict,
    timeout_s: float,
    while_draining: Callable[[], None] | None = None,
) -> list[str]:
    """Stream a chat completion, SIGTERM the child once the role chunk came (then call
    while_draining), read to the end (raises if the connection is cut mid-body); returns the
    `data:` payloads after the role chunk."""
    chat_url = url + "/v1/chat/completions"
    with httpx.stream("POST", chat_url, json=body, timeout=timeout_s) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is running
        child.send_signal(signal.SIGTERM)
        if while_draining is not None:
            while_draining()
        rest = list(lines)
    return [line[len("data: ") :] for line in rest if line.startswith("data: ")]


def assert_exited_cleanly(child: subprocess.Popen, timeout_s: float) -> None:
    assert child.wait(timeout_s) == 0
    assert child.stdout.read().strip() == "engine shut down"


def _is_ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/ready").status_code == 200
    return False


def main() -> None:
    engine = FakeEngine(sys.argv[1])
    engine.step_delay_s = float(sys.argv[2])
    grace_s = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    settings = Settings(server=ServerSettings(shutdown_grace_seconds=grace_s))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    server = build_server(create_app(engine, settings), settings)
    asyncio.run(server.serve(sockets=[listener]))
    print("engine shut down" if engine.shut_down else "engine still up", flush=True)


if __name__ == "__main__":
    main()
