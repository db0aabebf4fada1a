"""Run `kvshare serve`'s server over the FakeEngine (for the SIGTERM test, in a subprocess).

Usage: python serve_fake.py TOKENIZER_DIR STEP_DELAY_S [SHUTDOWN_GRACE_S (30)]
Prints the port it listens on, then serves until signalled.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from fake_engine import FakeEngine

from app.server import build_server, create_app
from app.settings import ServerSettings, Settings


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
