"""POST /v1/responses with stream: true over the FakeEngine: the event sequence per the spec,
its numbering, one terminal event always last, and agreement with the non-streamed call."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import fake_engine
import pytest
from fake_engine import Failure, FakeEngine
from helpers import MODEL, make_settings, post_then_disconnect, wait_ready
from openai_schemas import VENDORED, assert_valid
from tiny_tokenizer import FAKE_TEXTS

from app.responses.format import response_object
from app.responses.request import ResponsesRequest
from app.responses.stream import ResponseStream
from app.server import create_app
from app.serving.records import RequestRecord

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
TEXT_OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    """Room for a tools section in the prompt (the tiny tokenizer spells JSON in bytes)."""
    return FakeEngine(tokenizer_dir, max_model_len=4096)


def _event_schemas() -> dict[str, str]:
    """Event type -> the name of its member of the spec's ResponseStreamEvent."""
    schemas = json.loads(VENDORED.read_text())["schemas"]
    names = [m["$ref"].rsplit("/", 1)[-1] for m in schemas["ResponseStreamEvent"]["anyOf"]]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


EVENT_SCHEMAS = _event_schemas()


def parse_events(body: str) -> list[dict]:
    """The events of a Responses SSE body; each names its type in an `event:` line, each is
    valid against the spec's ResponseStreamEvent, and no `[DONE]` follows."""
    events = []
    for block in (b for b in body.split("\n\n") if b.strip()):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue  # a keep-alive comment
        assert len(lines) == 2 and lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        event = json.loads(lines[1][len("data: ") :])
        assert lines[0] == f"event: {event['type']}"
        assert_valid(EVENT_SCHEMAS[event["type"]], event)  # the member: a readable error
        assert_valid("ResponseStreamEvent", event)
        events.append(event)
    return events


def check_sequence(events: list[dict]) -> None:
    """Numbered 0, 1, ...; exactly one terminal event, the last."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] in TERMINAL for e in events] == [False] * (len(events) - 1) + [True]


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def without_ids(response: dict) -> dict:
    """A response with what differs between two calls (ids, timestamps) taken out."""
    drop = ("id", "created_at", "completed_at")
    output = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]
    ]
    return {k: v for k, v in response.items() if k not in drop} | {"output": output}


async def stream(client, body: dict) -> list[dict]:
    response = await client.post(RESPONSES, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_events(response.text)
    check_sequence(events)
    return events


async def test_text_events_in_order_and_the_same_response_as_unstreamed(client) -> None:
    body = {"model": MODEL, "input": "hi", "seed": 2, "metadata": {"k": "v"}}
    events = await stream(client, body)
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas > 1
    assert kinds == [
        *TEXT_OPENING,
        *["response.output_text.delta"] * num_deltas,
        *TEXT_CLOSING,
        "response.completed",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["id"] == final["id"] and created["metadata"] == {"k": "v"}
    message_id = events[2]["item"]["id"]
    assert {e.get("item_id", message_id) for e in events[2:-1]} == {message_id}
    assert final["output"][0]["id"] == message_id
    assert text_of(events) == FAKE_TEXTS[2] == final["output"][0]["content"][0]["text"]
    assert events[-4]["text"] == FAKE_TEXTS[2]
    unstreamed = (await client.post(RESPONSES, json=body)).json()
    assert without_ids(final) == without_ids(unstreamed)


async def test_max_output_tokens_cut_ends_with_response_incomplete(client, monkeypatch) -> None:
    monkeypatch.setattr(fake_engine, "FAKE_TEXTS", ["one two three four five " * 8])
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16}
    events = await stream(client, body)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["usage"]["output_tokens"] == 16
    assert text_of(events) == final["response"]["output"][0]["content"][0]["text"]
    [item_done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert item_done["item"]["status"] == "incomplete"
    unstreamed = (await client.post(RESPONSES, json=body)).json()
    assert without_ids(final["response"]) == without_ids(unstreamed)


@pytest.mark.parametrize("as_exception", [False, True])
async def test_an_engine_failure_mid_stream_ends_with_response_failed(
    client, engine: FakeEngine, as_exception: bool
) -> None:
    engine.failure = Failure(after_tokens=3, message="drill", as_exception=as_exception)
    events = await stream(client, {"model": MODEL, "input": "hi"})
    kinds = [e["type"] for e in events]
    assert kinds == [*TEXT_OPENING, *["response.output_text.delta"] * 3, "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "drill" in failed["error"]["message"]
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == text_of(events)
    assert failed["usage"]["output_tokens"] == 3
    request_id = engine.requests[0].request_id
    assert engine.aborts == [(request_id, None)] and engine.closed == [request_id]
    engine.failure = None
    ok = await client.post(RESPONSES, json={"model": MODEL, "input": "hi"})
    assert ok.status_code == 200 and ok.json()["status"] == "completed"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
async def test_a_forced_call_streams_function_call_events_only(
    client, engine: FakeEngine, tool_choice
) -> None:
    engine.script_text(CALL_TEXT)
    body = {"model": MODEL, "input": "weather?", "tools": TOOLS, "tool_choice": tool_choice}
    events = await stream(client, body)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *CALL_EVENTS,
        "response.completed",
    ]
    added, delta, done, item_done = events[2:6]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == '{"city": "Paris"}'
    assert done["name"] == "get_weather"
    final = events[-1]["response"]
    assert final["output"] == [item_done["item"]]
    assert {e["item_id"] for e in (delta, done)} == {added["item"]["id"], item_done["item"]["id"]}
    unstreamed = (await client.post(RESPONSES, json=body)).json()
    assert without_ids(final) == without_ids(unstreamed)


async def test_auto_text_then_a_call_is_a_message_then_a_function_call(
    client, engine: FakeEngine
) -> None:
    engine.script_text(f"Let me check. <tool_call>{CALL_TEXT}</tool_call>")
    body = {"model": MODEL, "input": "weather?", "tools": TOOLS}
    events = await stream(client, body)
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        *TEXT_OPENING,
        *["response.output_text.delta"] * num_deltas,
        *TEXT_CLOSING,
        *CALL_EVENTS,
        "response.completed",
    ]
    assert text_of(events) == "Let me check."
    assert {e["output_index"] for e in events[-5:-1]} == {1}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    unstreamed = (await client.post(RESPONSES, json=body)).json()
    assert without_ids(final) == without_ids(unstreamed)


@pytest.mark.parametrize(
    ("num_tokens", "outputs"),
    [
        (16, []),  # '{"name": "get_we': not even the name
        (45, [("get_weather", '{"city": "P', "incomplete")]),
        (50, [("get_weather", '{"city": "Paris"}', "completed")]),  # only the closing brace cut
    ],
)
async def test_a_forced_call_cut_short_is_an_incomplete_function_call(
    client, engine: FakeEngine, num_tokens, outputs
) -> None:
    engine.script_text(CALL_TEXT)
    body = {"model": MODEL, "input": "w", "tools": TOOLS, "tool_choice": "required"}
    body |= {"max_output_tokens": num_tokens}
    events = await stream(client, body)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *CALL_EVENTS * len(outputs),
        "response.incomplete",
    ]
    final = events[-1]["response"]
    items = [(i["name"], i["arguments"], i["status"]) for i in final["output"]]
    assert items == outputs
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done_items == final["output"]
    unstreamed = (await client.post(RESPONSES, json=body)).json()
    assert without_ids(final) == without_ids(unstreamed)


async def _post_then_disconnect(app, body: dict, disconnect: anyio.Event, sent: list) -> None:
    await post_then_disconnect(app, RESPONSES, body, disconnect, sent)


async def test_client_disconnect_mid_stream_aborts_the_request(engine: FakeEngine) -> None:
    engine.pause_after_tokens = 3
    app = create_app(engine, make_settings())
    sent: list[dict] = []
    async with app.router.lifespan_context(app):
        await wait_ready(app)
        disconnect = anyio.Event()
        body = {"model": MODEL, "input": "hi", "stream": True}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_post_then_disconnect, app, body, disconnect, sent)
            with anyio.fail_after(5):
                await engine.paused.wait()
            disconnect.set()
        request_id = engine.requests[0].request_id
        assert engine.aborts == [(request_id, None)]
        assert engine.closed == [request_id]
        assert app.state.kvshare.num_in_flight == 0
        metrics = app.state.kvshare.metrics.render().decode()
        assert 'kvshare_requests_total{finish_reason="abort"} 1.0' in metrics
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"response.output_text.delta" in bodies
    assert b"response.completed" not in bodies


async def test_a_refused_stream_is_a_400_before_any_event(client) -> None:
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 15}
    response = await client.post(RESPONSES, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_output_tokens"


async def test_the_end_of_the_drain_grace_ends_the_stream_with_response_failed(
    engine: FakeEngine,
) -> None:
    engine.pause_after_tokens = 2
    app = create_app(engine, make_settings())
    sent: list[dict] = []
    async with app.router.lifespan_context(app):
        await wait_ready(app)
        never = anyio.Event()  # the client stays
        body = {"model": MODEL, "input": "hi", "stream": True}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_post_then_disconnect, app, body, never, sent)
            with anyio.fail_after(5):
                await engine.paused.wait()
            app.state.kvshare.is_grace_over.set()
            with anyio.fail_after(5):
                while not any(m.get("more_body") is False for m in sent):
                    await anyio.sleep(0.01)
            never.set()
        assert engine.aborts == [(engine.requests[0].request_id, None)]
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = parse_events(text.decode())
    check_sequence(events)
    assert [e["type"] for e in events[-3:]] == ["response.output_text.delta"] * 2 + [
        "response.failed"
    ]
    assert events[-1]["response"]["error"]["code"] == "server_error"


async def test_the_finish_hook_makes_the_terminal_response(client) -> None:
    """What a store keeps is made by `finish`, from the chat response and the deltas."""
    serving = client.app.state.kvshare.serving
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "store": False})
    record = RequestRecord("finish-hook")
    prepared = await serving.prepare(body.to_chat_request(), record)
    seen: list[str] = []

    async def finish(chat, deltas, message_id) -> dict:
        seen.append("".join(delta.text for delta in deltas))
        return response_object(body, chat, message_id) | {"store": True}

    stream = ResponseStream(serving, prepared, record, body, finish)
    events = [event async for event in stream.run()]
    check_sequence(events)
    assert seen == [FAKE_TEXTS[0]]
    assert events[-1]["response"]["store"] is True
    assert events[0]["response"]["store"] is False
    assert events[-1]["response"]["output"][0]["id"] == events[2]["item"]["id"]
