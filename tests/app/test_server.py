"""A real uvicorn on 127.0.0.1 over the FakeEngine, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import Failure, FakeEngine
from helpers import MODEL, chat_body, make_settings
from serve_fake import assert_exited_cleanly, ready_child, sigterm_mid_stream
from tiny_tokenizer import FAKE_TEXTS

from app.server import DrainingServer, build_server, create_app
from app.settings import Settings

API_KEY = "test-key"
TIMEOUT_S = 20.0


class LiveServer:
    """uvicorn serving create_app(engine, settings) in a thread with its own event loop."""

    def __init__(self, engine: FakeEngine, settings: Settings) -> None:
        self.engine = engine
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.server: DrainingServer = build_server(create_app(engine, settings), settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop.run_until_complete(self.server.serve(sockets=[self.listener]))
        # What the end of the process would do: close connections uvicorn left open.
        for connection in list(self.server.server_state.connections):
            connection.transport.close()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready").status_code == 200:
                    return
            time.sleep(0.02)
        raise TimeoutError("the server did not become ready")

    def call(self, function, *args) -> None:
        """Run `function` on the server's loop (FakeEngine events belong to it)."""
        self.loop.call_soon_threadsafe(function, *args)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)


@contextlib.contextmanager
def live_server(engine: FakeEngine, settings: Settings | None = None) -> Iterator[LiveServer]:
    server = LiveServer(engine, settings or make_settings(api_keys=(API_KEY,)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def test_openai_client_streaming_and_not(engine: FakeEngine) -> None:
    with live_server(engine) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        messages = [{"role": "user", "content": "hi"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, seed=1)
        assert whole.choices[0].message.content == FAKE_TEXTS[1]
        assert whole.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices == []
        assert chunks[-1].usage == whole.usage
        completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert completion.choices[0].text == "Hello world"
        streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == "Hello world"


def test_openai_client_sees_errors(engine: FakeEngine) -> None:
    with live_server(engine) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            )
        assert bad.value.body["param"] == "tool_choice"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4", messages=messages)
        stranger = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        live.call(setattr, engine, "failure", Failure(after_tokens=2, message="boom"))
        with pytest.raises(openai.APIError, match="boom"):
            for _ in client.chat.completions.create(model=MODEL, messages=messages, stream=True):
                pass
        with pytest.raises(openai.InternalServerError, match="boom"):
            client.chat.completions.create(model=MODEL, messages=messages)
        live.call(setattr, engine, "failure", None)
        assert client.chat.completions.create(model=MODEL, messages=messages).choices


def _post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    def post() -> None:
        try:
            results.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S))
        except httpx.HTTPError as e:
            results.append(e)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_drain_lets_running_requests_finish(engine: FakeEngine) -> None:
    engine.pause_after_tokens = 2
    with live_server(engine, make_settings(shutdown_grace_seconds=30.0)) as live:
        results: list = []
        running = _post_in_thread(live.url, chat_body(), results)
        wait_until(engine.paused.is_set, "the request to reach the pause")
        live.call(live.server.begin_shutdown)
        wait_until(lambda: live.server.state.is_draining, "the drain to begin")
        assert httpx.get(live.url + "/ready").status_code == 503
        refused = httpx.post(live.url + "/v1/chat/completions", json=chat_body())
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        live.call(engine.resume.set)
        running.join(TIMEOUT_S)
        assert results[0].status_code == 200
        assert results[0].json()["choices"][0]["message"]["content"] == FAKE_TEXTS[0]
        live.thread.join(TIMEOUT_S)
        assert not live.thread.is_alive()
    assert engine.shut_down
    assert engine.aborts == []


def test_drain_past_the_grace_period_aborts_what_is_left(engine: FakeEngine) -> None:
    engine.pause_after_tokens = 2
    with live_server(engine, make_settings(shutdown_grace_seconds=0.1)) as live:
        results: list = []
        running = _post_in_thread(live.url, chat_body(stream=True), results)
        wait_until(engine.paused.is_set, "the request to reach the pause")
        live.call(live.server.begin_shutdown)
        live.thread.join(TIMEOUT_S)
        assert not live.thread.is_alive()
        running.join(TIMEOUT_S)
    assert engine.aborts == [(engine.requests[0].request_id, None)]
    assert engine.shut_down


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_then_exits(tokenizer_dir: Path) -> None:
    with ready_child(tokenizer_dir, 0.1, timeout_s=TIMEOUT_S) as (child, url):
        payloads = sigterm_mid_stream(
            child,
            url,
            chat_body(stream=True),
            TIMEOUT_S,
            while_draining=lambda: wait_until(
                lambda: httpx.get(url + "/ready").status_code == 503, "/ready to say 503"
            ),
        )
        assert payloads[-1] == "[DONE]"
        text = "".join(
            json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-1]
        )
        assert text == FAKE_TEXTS[0]
        assert_exited_cleanly(child, TIMEOUT_S)
