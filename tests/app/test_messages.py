"""POST /v1/messages and /v1/messages/count_tokens on the fake engine, driven by the official
anthropic SDK in process: the Message and its events (checked against the SDK's own types),
tools, the prompt each request renders to, usage, and errors as the SDK's exception types."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fake_engine import Failure, FakeEngine
from helpers import MODEL, make_settings, open_client
from pydantic import BaseModel, TypeAdapter

pytestmark = pytest.mark.anyio

EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli;"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    """Room for a tools section (the tiny tokenizer spells JSON in bytes)."""
    return FakeEngine(tokenizer_dir, max_model_len=4096)


def sdk_http(client: httpx.AsyncClient) -> httpx2.AsyncClient:
    """The SDK's own HTTP library (httpx2) on the in-process app of `client`."""
    transport = httpx2.ASGITransport(app=client.app, raise_app_exceptions=False)
    return httpx2.AsyncClient(transport=transport, base_url=str(client.base_url))


def sdk(client: httpx.AsyncClient, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(client.base_url), api_key=api_key, http_client=sdk_http(client), max_retries=0
    )


def body(**fields: object) -> dict:
    """Room for a tool call spelt in bytes by the tiny tokenizer."""
    return {"model": MODEL, "max_tokens": 400, "messages": USER, **fields}


def events_of(text: str) -> list[dict]:
    """The SSE events of a body, each checked: its `event:` name is its type, and it
    validates against the SDK's RawMessageStreamEvent (or is a ping or an error)."""
    events = []
    for block in (b for b in text.split("\n\n") if b.strip() and not b.startswith(":")):
        name_line, data_line = block.split("\n")  # data has no newline: JSON escapes them
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}"
        if event["type"] not in ("ping", "error"):
            EVENTS.validate_python(event)
        events.append(event)
    return events


def prompt_text(engine: FakeEngine, number: int = -1) -> str:
    return engine.tokenizer.decode(engine.requests[number].prompt_token_ids, False)


async def test_a_message_has_the_sdks_shape_and_usage_sums_to_the_prompt(tokenizer_dir):
    engine = FakeEngine(tokenizer_dir, num_cached_tokens=16, num_stored_prompt_tokens=8)
    async with open_client(engine) as client:
        message = await sdk(client).messages.create(**body())
    assert isinstance(message, Message) and message.id.startswith("msg_")
    assert message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    num_prompt = len(engine.requests[0].prompt_token_ids)
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (16, 8)
    assert usage.input_tokens == num_prompt - 16 - 8
    assert usage.output_tokens == len(engine.tokenizer.encode(block.text, False)) + 1  # EOS


async def test_the_stream_sends_every_event_in_order_and_agrees_with_the_message(client, engine):
    whole = (await client.post("/v1/messages", json=body())).json()
    response = await client.post("/v1/messages", json=body(stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == whole["usage"]
    async with sdk(client).messages.stream(**body()) as stream:
        final = await stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == Message(**whole).model_dump(exclude={"id"})


async def test_a_stop_sequence_and_max_tokens_are_the_stop_reason(client, engine) -> None:
    engine.script_text("Paris is sunny. Rome is warm.")
    cut = await sdk(client).messages.create(**body(stop_sequences=[" Rome"]))
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", " Rome")
    assert cut.content[0].text == "Paris is sunny."
    short = await sdk(client).messages.create(**body(max_tokens=3))
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


async def test_max_tokens_past_the_context_is_capped_not_refused(client, engine) -> None:
    message = (await client.post("/v1/messages", json=body(max_tokens=64000))).json()
    assert message["stop_reason"] == "end_turn"
    request = engine.requests[-1]
    assert request.sampling_params.max_tokens == 4096 - len(request.prompt_token_ids)
    too_long = body(messages=[{"role": "user", "content": "word " * 5000}])
    refused = await client.post("/v1/messages", json=too_long)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("messages: This model's maximum")


@pytest.mark.parametrize(
    ("tool_choice", "script"),
    [
        ({"type": "any"}, [CALL]),
        ({"type": "tool", "name": "get_weather"}, CALL),
        ({"type": "auto"}, f"Checking.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"),
    ],
)
async def test_tool_choice_gives_tool_use_blocks_whole_and_streamed(
    client, engine, tool_choice, script
) -> None:
    engine.script_text(script if isinstance(script, str) else json.dumps(script))
    message = await sdk(client).messages.create(**body(tools=TOOLS, tool_choice=tool_choice))
    assert message.stop_reason == "tool_use"
    call = message.content[-1]
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call.id.startswith("toolu_")
    assert [b.type for b in message.content[:-1]] == (
        ["text"] if "auto" in str(tool_choice) else []
    )
    streamed = body(tools=TOOLS, tool_choice=tool_choice, stream=True)
    events = events_of((await client.post("/v1/messages", json=streamed)).text)
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert [json.loads("".join(partial))] == [{"city": "Paris"}]
    async with sdk(client).messages.stream(**body(tools=TOOLS, tool_choice=tool_choice)) as stream:
        final = await stream.get_final_message()
    assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


async def test_tool_choices_reach_the_engine_as_the_chat_grammars(client, engine) -> None:
    kinds = {}
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "none"}):
        await client.post("/v1/messages", json=body(tools=TOOLS, tool_choice=choice))
        structured = engine.requests[-1].sampling_params.structured
        kinds[choice["type"]] = None if structured is None else structured.kind
    assert kinds == {"auto": "tool_calls", "any": "json_schema", "none": None}
    single = body(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    await client.post("/v1/messages", json=single)
    schema = json.loads(engine.requests[-1].sampling_params.structured.schema)
    assert schema.get("type") != "array"  # one call, not a list of them


async def test_a_tool_result_round_trip_renders_the_call_and_its_result(client, engine) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user wants weather.", "signature": "s"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": CALL["arguments"],
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 20C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    message = await sdk(client).messages.create(**body(tools=TOOLS, messages=history))
    assert message.stop_reason == "end_turn"
    prompt = prompt_text(engine)
    assert "Sunny, 20C" in prompt and "And tomorrow?" in prompt and '"Paris"' in prompt
    assert "The user wants weather." not in prompt  # earlier turns' thinking is dropped
    failed = json.loads(json.dumps(history))
    failed[2]["content"][0] |= {"is_error": True, "content": [{"type": "text", "text": "down"}]}
    await sdk(client).messages.create(**body(tools=TOOLS, messages=failed))
    assert "Error: down" in prompt_text(engine)


async def test_cache_control_and_system_blocks_change_nothing_in_the_prompt(client, engine):
    plain = body(system="Be brief.\nAnswer in French.", tools=TOOLS)
    ephemeral = {"type": "ephemeral"}
    marked = body(
        system=[
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": "Answer in French.", "cache_control": ephemeral},
        ],
        tools=[{**TOOLS[0], "cache_control": ephemeral | {"ttl": "1h"}}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": USER[0]["content"], "cache_control": ephemeral}
                ],
            }
        ],
    )
    for request in (plain, marked):
        await client.post("/v1/messages", json=request)
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids
    assert "Answer in French." in prompt_text(engine)


async def test_the_billing_line_is_stripped_only_when_the_setting_says(engine) -> None:
    first_line = body(system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "Hi."}])
    without = body(system="Hi.")
    async with open_client(engine, make_settings(strip_volatile_system_lines=True)) as client:
        counted = [
            (await client.post("/v1/messages/count_tokens", json=counting(r))).json()
            for r in (first_line, without)
        ]
        for request in (first_line, without):
            await client.post("/v1/messages", json=request)
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids
    assert counted[0] == counted[1] == {"input_tokens": len(engine.requests[0].prompt_token_ids)}
    assert [r.num_volatile_prefix_tokens for r in engine.requests] == [0, 0]
    async with open_client(engine) as client:
        await client.post("/v1/messages", json=first_line)
        await client.post("/v1/messages", json=without)
    assert BILLING in prompt_text(engine, -2)
    kept = engine.requests[-2]  # the engine is told where the line ends, in tokens
    num_tokens = kept.num_volatile_prefix_tokens
    assert BILLING in engine.tokenizer.decode(kept.prompt_token_ids[:num_tokens], False)
    assert BILLING not in engine.tokenizer.decode(kept.prompt_token_ids[: num_tokens - 2], False)
    assert engine.requests[-1].num_volatile_prefix_tokens == 0


def counting(request: dict) -> dict:
    return {k: v for k, v in request.items() if k not in ("max_tokens", "stream")}


async def test_count_tokens_is_the_prompt_the_message_runs_on(client, engine) -> None:
    request = body(system="Be brief.", tools=TOOLS, tool_choice={"type": "auto"})
    counted = await sdk(client).messages.count_tokens(**counting(request))
    await client.post("/v1/messages", json=request)
    assert counted.input_tokens == len(engine.requests[-1].prompt_token_ids)
    beta = await client.post("/v1/messages/count_tokens?beta=true", json=counting(request))
    assert beta.json() == {"input_tokens": counted.input_tokens}


async def test_thinking_and_agent_options_are_accepted(client, engine) -> None:
    agent = body(
        thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": '{"session_id": "s1"}'},
        messages=[*USER, {"role": "system", "content": "Skills: none."}],
    )
    response = await client.post("/v1/messages?beta=true", json=agent)
    assert response.status_code == 200, response.text
    assert "Skills: none." in prompt_text(engine)
    sdk_fields = {"eager_input_streaming": True, "input_examples": [{"city": "Paris"}]}
    tools = [{**TOOLS[0], **sdk_fields, "defer_loading": False}]
    newer = body(tools=tools, cache_control={"type": "ephemeral"}, speed="standard")
    assert (await client.post("/v1/messages", json=newer)).status_code == 200
    counted = await client.post("/v1/messages/count_tokens", json=counting(newer))
    assert counted.status_code == 200, counted.text
    thought = {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}]}
    only_thinking = body(messages=[*USER, thought])  # nothing to continue: a new answer
    assert (await client.post("/v1/messages", json=only_thinking)).status_code == 200
    await client.post("/v1/messages", json=body())
    assert engine.requests[-2].prompt_token_ids == engine.requests[-1].prompt_token_ids
    enabled = body(thinking={"type": "enabled", "budget_tokens": 2048}, max_tokens=4000)
    assert (await client.post("/v1/messages", json=enabled)).status_code == 200


class Weather(BaseModel):
    city: str
    days: int


async def test_output_config_format_is_enforced_and_the_sdk_parses_it(client, engine) -> None:
    engine.script_text('{"city": "Paris", "days": 2}')
    parsed = await sdk(client).messages.parse(**body(), output_format=Weather)
    assert parsed.parsed_output == Weather(city="Paris", days=2)
    structured = engine.requests[-1].sampling_params.structured
    assert structured.kind == "json_schema"
    assert set(json.loads(structured.schema)["properties"]) == {"city", "days"}


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": WEATHER}]}, "tools[0].name"),
    ({"tools": [{**TOOLS[0], "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"stop_sequences": ["a"] * 17}, "stop_sequences has 17"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "not": {}}}]},
        "tools[0].input_schema",
    ),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    (
        {
            "output_config": {
                "format": {"type": "json_schema", "schema": {"type": "object", "not": {}}}
            }
        },
        "output_config.format",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}],
                }
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_input_is_an_anthropic_400_naming_the_field(client, engine, fields, param):
    request = {k: v for k, v in body(**fields).items() if v is not None}
    response = await client.post("/v1/messages", json=request)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"], error
    assert engine.requests == []  # nothing reached the engine
    with pytest.raises(anthropic.BadRequestError) as caught:  # the SDK's own type for it
        await sdk(client).messages.create(**body(), extra_body=fields)
    assert param in caught.value.body["error"]["message"]


async def test_errors_are_the_sdks_exception_types(engine) -> None:
    settings = make_settings(api_keys=("key-a",), max_waiting_requests=1)
    async with open_client(engine, settings) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await sdk(client, "wrong").messages.create(**body())
        assert caught.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.NotFoundError):
            await sdk(client, "key-a").messages.create(**body(model="claude-nope"))
        assert (await sdk(client, "key-a").messages.create(**body())).content  # x-api-key
        bearer = anthropic.AsyncAnthropic(
            base_url=str(client.base_url), auth_token="key-a", http_client=sdk_http(client)
        )
        assert (await bearer.messages.create(**body())).content
        engine.waiting = 1
        with pytest.raises(anthropic.RateLimitError):
            await sdk(client, "key-a").messages.create(**body())
    assert engine.requests[0].cache_salt == engine.requests[1].cache_salt  # one tenant


async def test_a_failure_mid_stream_is_an_error_event_and_the_sdk_raises(client, engine):
    engine.failure = Failure(after_tokens=2, message="boom")
    response = await client.post("/v1/messages", json=body(stream=True))
    events = events_of(response.text)
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError):
        async with sdk(client).messages.stream(**body()) as stream:
            await stream.get_final_message()


async def test_anthropics_diagnostics_say_what_changed_since_the_previous_message(client):
    system = "Be brief."
    first = await sdk(client).messages.create(**body(system=system), diagnostics={})
    assert first.diagnostics is None  # nothing to compare yet
    follow_up = [
        *USER,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And tomorrow?"},
    ]
    previous = {"previous_message_id": first.id}
    grown = await sdk(client).messages.create(
        **body(system=system, messages=follow_up), diagnostics=previous
    )
    assert grown.diagnostics is None  # it only appends to the previous prompt
    changed = await sdk(client).messages.create(**body(system="Be long."), diagnostics=previous)
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > 0
    reworded = [{"role": "user", "content": "What is the weather in Rome?"}]
    messages = await sdk(client).messages.create(
        **body(system=system, messages=reworded), diagnostics=previous
    )
    assert messages.diagnostics.cache_miss_reason.type == "messages_changed"
    unknown = {"previous_message_id": "msg_000000000000000000000000"}
    lost = await sdk(client).messages.create(**body(), diagnostics=unknown)
    assert lost.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    assert "cache_diagnostics" not in lost.model_dump()  # the extension was not asked for


async def test_the_cache_diagnostics_extension_works_whole_and_streamed(client) -> None:
    first = (await client.post("/v1/messages", json=body())).json()
    asked = {"compare_to": first["id"]}
    whole = (await client.post("/v1/messages", json=body(cache_diagnostics=asked))).json()
    assert whole["cache_diagnostics"]["compare_to"]["id"] == "chatcmpl-" + first["id"][4:]
    assert whole["cache_diagnostics"]["compare_to"]["first_difference_index"] is None
    streamed = body(cache_diagnostics=True, stream=True)
    events = events_of((await client.post("/v1/messages", json=streamed)).text)
    [delta] = [event for event in events if event["type"] == "message_delta"]
    assert delta["cache_diagnostics"]["prompt_tokens"] == delta["usage"]["input_tokens"]
