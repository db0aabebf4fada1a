"""Readiness, draining, disconnects, request ids and access logs."""

from __future__ import annotations

import json
import logging

import anyio
import pytest
from fake_engine import FakeEngine
from helpers import (
    assert_aborted_at_the_pause,
    chat_body,
    make_settings,
    open_client,
    post_then_disconnect,
    wait_ready,
)
from openai_schemas import assert_valid
from tiny_tokenizer import FAKE_TEXTS

from app.server import JsonFormatter, create_app

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


async def test_lifespan_starts_and_shuts_down_the_engine(engine: FakeEngine) -> None:
    async with open_client(engine) as client:
        assert engine.started and not engine.shut_down
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/ready")).json() == {"status": "ready"}
    assert engine.shut_down


async def test_ready_waits_for_the_engine(engine: FakeEngine) -> None:
    engine.ready = False
    async with open_client(engine) as client:
        response = await client.get("/ready")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"
        engine.ready = True
        await wait_ready(client.app)
        assert (await client.get("/ready")).status_code == 200
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake-model"


async def test_load_error_is_reported_by_ready(engine: FakeEngine) -> None:
    engine.ready = False
    engine.error_on_load = "no weights at /nowhere"
    async with open_client(engine) as client:
        with anyio.fail_after(5):
            while client.app.state.kvshare.load_error is None:
                await anyio.sleep(0.01)
        response = await client.get("/ready")
        assert response.status_code == 503
        assert "no weights at /nowhere" in response.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200


async def test_draining_turns_ready_and_new_requests_to_503(client, engine) -> None:
    client.app.state.kvshare.begin_drain()
    ready = await client.get("/ready")
    assert ready.status_code == 503
    assert ready.json()["error"]["code"] == "draining"
    response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "draining"
    assert engine.requests == []


async def test_served_model_name_replaces_the_engine_name(engine) -> None:
    async with open_client(engine, make_settings(served_model_name="my-model")) as client:
        models = (await client.get("/v1/models")).json()
        assert_valid("ListModelsResponse", models)
        assert [m["id"] for m in models["data"]] == ["my-model"]
        assert models["data"][0]["max_model_len"] == 256
        assert (await client.get("/v1/models/my-model")).json() == models["data"][0]
        body = chat_body()
        body["model"] = "my-model"
        response = await client.post(CHAT, json=body)
        assert response.json()["model"] == "my-model"


# -- disconnects, driven through raw ASGI so the moment is exact ------------------------------


async def _call(app, body: dict, disconnect: anyio.Event, sent: list[dict], send_override=None):
    headers = [(b"x-request-id", b"gone-1")]
    await post_then_disconnect(app, CHAT, body, disconnect, sent, headers, send_override)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_request(engine: FakeEngine, stream: bool) -> None:
    engine.pause_after_tokens = 3
    app = create_app(engine, make_settings())
    sent: list[dict] = []
    async with app.router.lifespan_context(app):
        await wait_ready(app)
        disconnect = anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_call, app, chat_body(stream=stream), disconnect, sent)
            with anyio.fail_after(5):
                await engine.paused.wait()  # 3 tokens out, the engine holds the 4th step
            disconnect.set()
        # Aborted while the engine was still paused: no further step was needed.
        metrics = assert_aborted_at_the_pause(app, engine)
        assert 'kvshare_requests_total{finish_reason="abort"} 1.0' in metrics
    if stream:
        bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b'"content": "Hello"' in bodies
        assert b"[DONE]" not in bodies
    else:
        assert sent[0]["status"] == 499


# -- request ids and logs --------------------------------------------------------------------


async def test_request_id_is_honoured_or_made(client) -> None:
    given = await client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = await client.get("/health")
    assert len(made.headers["x-request-id"]) == 32
    unsafe = await client.get("/health", headers={"X-Request-Id": "a b\tc"})
    assert unsafe.headers["x-request-id"] != "a b\tc"
    assert len(unsafe.headers["x-request-id"]) == 32


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_one_access_log_line_per_request(engine, caplog, log_prompts: bool) -> None:
    caplog.set_level(logging.INFO, logger="kvshare.access")
    settings = make_settings(log_prompts=log_prompts)
    async with open_client(engine, settings) as client:
        headers = {"X-Request-Id": "req-7"}
        response = await client.post(CHAT, json=chat_body("secret words"), headers=headers)
    lines = [r for r in caplog.records if r.name == "kvshare.access"]
    assert len(lines) == 1
    fields = lines[0].fields
    usage = response.json()["usage"]
    assert fields["request_id"] == "req-7"
    assert fields["status"] == 200
    assert fields["path"] == CHAT
    assert fields["prompt_tokens"] == usage["prompt_tokens"]
    assert fields["completion_tokens"] == usage["completion_tokens"]
    assert fields["ttft_s"] is not None
    assert fields["finish_reason"] == "stop"
    assert ("secret words" in lines[0].getMessage()) is log_prompts
    assert ("secret words" in fields.get("prompt", "")) is log_prompts
    as_json = json.loads(JsonFormatter().format(lines[0]))
    assert as_json["request_id"] == "req-7"
    assert as_json["level"] == "info"
    assert as_json["status"] == 200


async def test_idle_streams_get_keep_alive_comments(engine: FakeEngine) -> None:
    engine.pause_after_tokens = 2
    app = create_app(engine, make_settings(keepalive_seconds=0.01))
    sent: list[dict] = []

    def body_so_far() -> bytes:
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    async with app.router.lifespan_context(app):
        await wait_ready(app)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_call, app, chat_body(stream=True), anyio.Event(), sent)
            with anyio.fail_after(5):
                await engine.paused.wait()
                while b": keep-alive\n\n" not in body_so_far():
                    await anyio.sleep(0.01)
            engine.resume.set()
    payloads = [line for line in body_so_far().decode().split("\n\n") if line.startswith("data:")]
    assert payloads[-1] == "data: [DONE]"
    contents = [json.loads(p[len("data: ") :])["choices"][0]["delta"] for p in payloads[:-1]]
    assert "".join(delta.get("content", "") for delta in contents) == FAKE_TEXTS[0]
    assert engine.aborts == []


async def test_disconnect_during_a_send_aborts_before_the_response_returns(engine) -> None:
    """The client vanishes while a chunk is being written (a stalled socket): the stream is
    cancelled with its body generator suspended at a yield; it must be closed (and the
    request aborted) by the response itself, not later by garbage collection."""
    app = create_app(engine, make_settings())
    disconnect = anyio.Event()
    sent: list[dict] = []
    aborts_when_returned: list = []

    async def stalled_send(message: dict) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) == 3:
            disconnect.set()
            await anyio.sleep_forever()

    async def call() -> None:
        await _call(app, chat_body(stream=True), disconnect, [], send_override=stalled_send)
        aborts_when_returned.extend(engine.aborts)

    async with app.router.lifespan_context(app):
        await wait_ready(app)
        with anyio.fail_after(5):
            await call()
    assert aborts_when_returned == [(engine.requests[0].request_id, None)]
