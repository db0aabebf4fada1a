"""Run the server once in an image's build stage, so the runtime stage gets what a start needs.

`python scripts/warm_image.py CONFIG`: starts `kvshare serve --config CONFIG` on loopback
(which converts the embedded default model into $KVSHARE_CACHE_DIR), sends the requests whose
paths import the most code (chat, a stream, a JSON-schema answer, a tool call, completions with
logprobs, /metrics), then stops it with SIGTERM. Run after every `__pycache__` was deleted, it
leaves bytecode for exactly the modules a serving process imports: the rest of the venv's
bytecode (about 200 MB, mostly torch, transformers and sympy modules a server never loads) stays
out of the image. Exits non-zero when any request fails, so a broken image fails its build.
Standard library only.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def call(url: str, body: dict | None = None, timeout_s: float = 300) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kvshare serve exited with {server.returncode} before /ready")
        try:
            call(f"{base_url}/ready", timeout_s=5)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise SystemExit(f"kvshare serve not ready after {timeout_s:.0f}s")


def requests(model: str) -> list[tuple[str, dict]]:
    user = [{"role": "user", "content": "Name a colour."}]
    chat = {"model": model, "messages": user, "max_tokens": 4}
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}}
    tool = {
        "type": "function",
        "function": {"name": "paint", "parameters": schema},
    }
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    json_format = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    tool_call = {**chat, "max_tokens": 24, "tools": [tool], "tool_choice": "required"}
    completion = {"model": model, "prompt": "Red", "max_tokens": 2, "logprobs": 2, "echo": True}
    return [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", stream),
        ("/v1/chat/completions", {**chat, "max_tokens": 12, "response_format": json_format}),
        ("/v1/chat/completions", tool_call),
        ("/v1/completions", completion),
    ]


def main(argv: list[str]) -> int:
    config = argv[1] if len(argv) > 1 else "config/cpu.yaml"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = ["kvshare", "serve", "--config", config, "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command)
    try:
        wait_ready(base_url, server)
        model = json.loads(call(f"{base_url}/v1/models"))["data"][0]["id"]
        for path, body in requests(model):
            try:
                call(base_url + path, body)
            except urllib.error.HTTPError as error:
                raise SystemExit(f"{path}: {error.code} {error.read().decode()[:500]}") from None
        call(f"{base_url}/metrics")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    print(f"warm_image: served {len(requests(model))} requests, server exited {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
