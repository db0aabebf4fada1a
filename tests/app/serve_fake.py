"""Run `kvshare serve`'s server over the FakeEngine (for the SIGTERM test, in a subprocess).

Usage: python serve_fake.py TOKENIZER_DIR STEP_DELAY_S [SHUTDOWN_GRACE_S (30)]
Prints the port it listens on, then serves until signalled.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

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
