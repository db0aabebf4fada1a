"""A real `kvshare serve` (real engine, real uvicorn on 127.0.0.1) for integration tests: start
one, and read its /metrics. The benchmarks start theirs through benchmarks/serving.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

# One definition each, shared with the benchmarks (which never import tests/).
from benchmarks.servers import free_port as free_port
from benchmarks.servers import scrape as scrape

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def running_server(
    *flags: str, env: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> Iterator[str]:
    """Start `kvshare serve` with config/cpu.yaml plus `flags`; yield its base URL. Its log
    (stderr) goes to `stderr` if given, else to a pipe read when it fails to start.

    The exact mode (--quantization none) unless `flags` choose: the HF oracle's equalities hold
    only there, and config/cpu.yaml serves fp16 weights."""
    with running_process(*flags, env=env, stderr=stderr) as (_, base_url):
        yield base_url


@contextmanager
def running_process(
    *flags: str, env: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """running_server(), yielding the process too (to kill it); stopped at the end if alive."""
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if "--quantization" not in flags:
        command += ["--quantization", "none"]
    command += flags
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process)
        yield process, base_url
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen) -> None:
    """SIGINT (a graceful stop), then SIGKILL after 30 s (nothing if it has exited)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = process.stderr.read()[-4000:] if process.stderr else "(its log went to a file)"
            raise RuntimeError(f"server exited early:\n{log}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready in time")
