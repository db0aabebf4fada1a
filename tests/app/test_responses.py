"""POST /v1/responses over the FakeEngine: the chat pipeline serves it; shapes per the spec."""

from __future__ import annotations

import anyio
import fake_engine
import pytest
from fake_engine import FakeEngine
from helpers import (
    MODEL,
    assert_aborted_at_the_pause,
    make_settings,
    post_then_disconnect,
    wait_ready,
)
from openai_schemas import assert_valid
from tiny_tokenizer import FAKE_TEXTS

from app.responses.request import input_messages
from app.server import create_app

pytestmark = pytest.mark.anyio


async def test_string_input_is_a_chat_turn(client, engine: FakeEngine) -> None:
    engine.num_cached_tokens = 3
    body = {"model": MODEL, "input": "hi", "instructions": "be brief"}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid("Response", data)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.apply_chat_template(messages)
    assert data["object"] == "response" and data["status"] == "completed"
    assert data["output"][0]["status"] == "completed"
    assert data["output"][0]["content"][0]["text"] == FAKE_TEXTS[0]
    usage = data["usage"]
    assert usage["input_tokens"] == len(engine.requests[0].prompt_token_ids)
    assert usage["input_tokens_details"] == {
        "cached_tokens": 3,
        "cache_write_tokens": usage["input_tokens"] - 3,
    }
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_function_call_items_become_one_assistant_message_and_a_tool_reply() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]
    calls = [
        {"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}}
        for c, n in (("c1", "f"), ("c2", "g"))
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


async def test_message_items_render_as_chat_messages(client, engine: FakeEngine) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "message", "role": "user", "content": "more"},
    ]
    response = await client.post("/v1/responses", json={"model": MODEL, "input": items})
    assert response.status_code == 200, response.text
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"},
    ]
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.apply_chat_template(messages)


async def test_max_output_tokens_cut_is_incomplete(client, monkeypatch) -> None:
    monkeypatch.setattr(fake_engine, "FAKE_TEXTS", ["one two three four five " * 8])
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16}
    data = (await client.post("/v1/responses", json=body)).json()
    assert_valid("Response", data)
    assert data["status"] == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["output"][0]["status"] == "incomplete"  # the cut message
    assert data["usage"]["output_tokens"] == 16
    assert data["max_output_tokens"] == 16


TOOL = {"type": "function", "name": "f"}
NO_NAME = {"parameters": {"type": "object", "properties": {}}}
BAD_INPUT = [
    ({"input": "hi"}, "model"),
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": 5}, "input"),
    ({"model": MODEL, "input": [{"type": "image"}]}, "input[0].type"),
    (
        {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "x", "output": ""}]},
        "input[0].call_id",
    ),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 15}, "max_output_tokens"),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 1.5}, "max_output_tokens"),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "function", **NO_NAME}]}, "tools[0].name"),
    ({"model": MODEL, "input": "hi", "tools": [TOOL, {**TOOL, "name": "a b"}]}, "tools[1].name"),
    (
        {"model": MODEL, "input": "hi", "tools": [{**TOOL, "parameters": [1]}]},
        "tools[0].parameters",
    ),
    ({"model": MODEL, "input": "hi", "tools": [{**TOOL, "function": {}}]}, "tools[0].function"),
    ({"model": MODEL, "input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"model": MODEL, "input": "hi", "background": True}, "background"),
    ({"model": MODEL, "input": "hi", "include": ["file_search_call.results"]}, "include"),
    (
        {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema"}}},
        "text.format",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_INPUT)
async def test_bad_input_is_a_400_naming_the_field(client, body: dict, param: str) -> None:
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert ok.status_code == 200


async def test_a_bad_function_tool_field_is_named_in_the_message(client) -> None:
    body = {"model": MODEL, "input": "hi", "tools": [TOOL, {"type": "function", **NO_NAME}]}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[1].name"
    assert error["message"] == "tools[1].name: Field required"


async def test_a_client_that_leaves_aborts_the_request_and_stores_nothing(
    engine: FakeEngine,
) -> None:
    """Not streamed: the disconnect is seen while the engine still runs the request."""
    engine.pause_after_tokens = 3
    app = create_app(engine, make_settings())
    sent: list[dict] = []
    body = {"model": MODEL, "input": "hi"}  # store defaults to true
    async with app.router.lifespan_context(app):
        await wait_ready(app)
        disconnect = anyio.Event()
        with anyio.fail_after(5):  # before the fix: the request waits on the paused engine
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(post_then_disconnect, app, "/v1/responses", body, disconnect, sent)
                await engine.paused.wait()  # 3 tokens out, the engine holds the 4th step
                disconnect.set()
        metrics = assert_aborted_at_the_pause(app, engine)
    assert 'kvshare_requests_total{finish_reason="abort"} 1.0' in metrics
    assert "kvshare_stored_responses 0.0" in metrics
    assert [(m["type"], m.get("status")) for m in sent] == [
        ("http.response.start", 499),
        ("http.response.body", None),
    ]
