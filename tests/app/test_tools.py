"""Function tools on chat: validation (400s naming the field), the grammar each tool_choice
asks for, the prompt (template or generic format), tool calls in responses and streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers import chat_body, spy_schema_serializations, sse_chunks
from openai_schemas import assert_valid
from tiny_tokenizer import build_tiny_tokenizer

from app.openai.json_schema import canonical_json
from app.openai.structured_output import MAX_PARALLEL_TOOL_CALLS, NO_ARGUMENTS
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TIME_CALL = {"name": "get_time", "arguments": {}}


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    """Room for the tools section of the prompt (the tiny tokenizer spells JSON in bytes)."""
    return FakeEngine(tokenizer_dir, max_model_len=4096)


def tools_body(**fields: object) -> dict:
    fields = {"tools": TOOLS, "max_tokens": 400, **fields}
    return chat_body("What is the weather in Paris?", **fields)


# -- validation -------------------------------------------------------------------------------

HISTORY_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools[0].function.parameters",
    ),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_tool_fields_get_400_naming_the_field(client, engine, fields, param) -> None:
    body = {**tools_body(), **fields}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


async def test_tool_choice_without_tools_is_a_400(client) -> None:
    response = await client.post(CHAT, json=chat_body(tool_choice="auto"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"


async def test_parameters_schema_is_checked_like_response_format(client) -> None:
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "tag", "parameters": tags}}]
    response = await client.post(CHAT, json=tools_body(tools=tools, tool_choice="required"))
    error = response.json()["error"]
    assert response.status_code == 400
    assert error["param"] == "tools[0].function.parameters"
    assert "uniqueItems" in error["message"]
    assert error["message"].startswith("tools[0].function.parameters")


BAD_HISTORY = [
    (
        {"role": "assistant", "content": None, "tool_calls": [
            {**HISTORY_CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
        ]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        {"role": "assistant", "content": None, "tool_calls": [
            {**HISTORY_CALL, "function": {"name": "get_weather", "arguments": {"city": "P"}}}
        ]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": None}, "messages[1].content"),
    ({"role": "user", "content": "x", "tool_calls": [HISTORY_CALL]}, "messages[1].tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize(("message", "param"), BAD_HISTORY)
async def test_bad_history_messages_get_400(client, engine, message, param) -> None:
    body = tools_body()
    body["messages"] = [body["messages"][0], message]
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- the grammar each tool_choice asks for ----------------------------------------------------


def call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


WEATHER_CALL = call_schema("get_weather", WEATHER)
TIME_SCHEMA = call_schema("get_time", NO_ARGUMENTS)
LISTED = [
    {"name": "get_weather", "parameters": WEATHER},
    {"name": "get_time", "parameters": NO_ARGUMENTS},
]
STRUCTURED = [
    ({}, "tool_calls", LISTED),
    ({"tool_choice": "auto"}, "tool_calls", LISTED),
    ({"tool_choice": "none"}, None, None),
    ({"tool_choice": NAMED}, "json_schema", WEATHER_CALL),
    (
        {"tool_choice": "required"},
        "json_schema",
        {
            "type": "array",
            "items": {"anyOf": [WEATHER_CALL, TIME_SCHEMA]},
            "minItems": 1,
            "maxItems": MAX_PARALLEL_TOOL_CALLS,
        },
    ),
    (
        {"tool_choice": "required", "parallel_tool_calls": False},
        "json_schema",
        {"anyOf": [WEATHER_CALL, TIME_SCHEMA]},
    ),
    (
        {"tool_choice": "required", "parallel_tool_calls": False, "tools": TOOLS[:1]},
        "json_schema",
        WEATHER_CALL,
    ),
]


@pytest.mark.parametrize(("fields", "kind", "schema"), STRUCTURED)
async def test_tool_choice_reaches_the_engine_as_its_grammar(client, engine, fields, kind, schema):
    response = await client.post(CHAT, json={**tools_body(), **fields})
    assert response.status_code == 200, response.text
    structured = engine.requests[0].sampling_params.structured
    if kind is None:
        assert structured is None
    else:
        assert (structured.kind, json.loads(structured.schema)) == (kind, schema)


@pytest.mark.parametrize("fields", [fields for fields, kind, _ in STRUCTURED if kind])
async def test_parameters_are_serialized_once_per_request(client, engine, monkeypatch, fields):
    """The size caps (app/serving/limits.py) and the keyword check share one canonical text of each
    tool's parameters; the grammar's own document (the calls around them) is one more."""
    serialized = spy_schema_serializations(monkeypatch)
    response = await client.post(CHAT, json={**tools_body(), **fields})
    assert response.status_code == 200, response.text
    assert serialized.count(WEATHER) == 1
    assert len(serialized) == 2


async def test_call_grammar_puts_the_name_first_and_canonical_parameters(client, engine):
    reordered = dict(reversed(list(WEATHER.items())))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": reordered}}]
    for body in (tools_body(tool_choice=NAMED), tools_body(tool_choice=NAMED, tools=tools)):
        assert (await client.post(CHAT, json=body)).status_code == 200
    first, second = (r.sampling_params.structured.schema for r in engine.requests)
    assert first == second
    assert first.index('"name"') < first.index('"arguments"')
    assert canonical_json(WEATHER) in first


# -- prompt -----------------------------------------------------------------------------------


def prompt_text(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[0].prompt_token_ids, skip_special_tokens=False)


async def test_template_without_tools_gets_the_generic_format(client, engine) -> None:
    body = tools_body()
    body["messages"] = [
        {"role": "system", "content": "Be brief."},
        body["messages"][0],
        {"role": "assistant", "content": None, "tool_calls": [HISTORY_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert (await client.post(CHAT, json=body)).status_code == 200
    text = prompt_text(engine)
    listed = json.dumps(TOOLS[0]["function"])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{listed}\n" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


async def test_tools_section_becomes_the_system_message(client, engine) -> None:
    assert (await client.post(CHAT, json=tools_body(tool_choice="none"))).status_code == 200
    assert prompt_text(engine).startswith("<|im_start|>system\n# Tools\n")


TOOLS_TEMPLATE = (
    "{%- if tools %}{{ 'TOOLS ' + tools | tojson + '|' }}{% endif %}"
    "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{%- for c in m.get('tool_calls', []) %} CALL {{ c.function.name }}"
    " {{ c.function.arguments | tojson }}{% endfor %}{{ '|' }}{% endfor %}"
)


def test_template_that_reads_tools_gets_them(tmp_path: Path) -> None:
    tokenizer = Tokenizer(build_tiny_tokenizer(tmp_path, chat_template=TOOLS_TEMPLATE))
    assert tokenizer.template_takes_tools
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        ]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]  # fmt: skip
    text = tokenizer.render_chat(messages, tools=TOOLS[:1])
    assert text == (
        f'TOOLS {json.dumps(TOOLS[:1])}|user: hi|assistant:  CALL f {{"a": 1}}|tool: ok|'
    )


# -- responses --------------------------------------------------------------------------------


def calls_of(message: dict) -> list[dict]:
    return [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in message["tool_calls"]
    ]


async def test_named_call_is_a_tool_call_message(client, engine) -> None:
    engine.script_text(json.dumps(CALL))
    body = (await client.post(CHAT, json=tools_body(tool_choice=NAMED))).json()
    assert_valid("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}


async def test_required_parallel_calls_get_unique_ids(client, engine) -> None:
    engine.script_text(json.dumps([CALL, TIME_CALL]))
    body = (await client.post(CHAT, json=tools_body(tool_choice="required", n=2))).json()
    for choice in body["choices"]:
        assert calls_of(choice["message"]) == [CALL, TIME_CALL]
    ids = [c["id"] for choice in body["choices"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 4


AUTO_TEXT = f"Let me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


async def test_auto_splits_content_and_calls(client, engine) -> None:
    engine.script_text(AUTO_TEXT)
    body = (await client.post(CHAT, json=tools_body())).json()
    assert_valid("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert calls_of(message) == [CALL]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_text_without_a_call_is_plain_content(client, engine) -> None:
    engine.script_text("It is <b>sunny</b>, < 30 degrees.")
    body = (await client.post(CHAT, json=tools_body())).json()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "It is <b>sunny</b>, < 30 degrees.",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_tool_choice_none_never_parses_calls(client, engine) -> None:
    engine.script_text(AUTO_TEXT)
    body = (await client.post(CHAT, json=tools_body(tool_choice="none"))).json()
    assert body["choices"][0]["message"]["content"] == AUTO_TEXT
    assert "tool_calls" not in body["choices"][0]["message"]


PARALLEL_TEXT = json.dumps([CALL, TIME_CALL])
WEATHER_ARGUMENTS = json.dumps(CALL["arguments"])
# (tool_choice, text, max_tokens) -> the calls of the text cut there (a token per character)
CUT_CALLS = [
    (NAMED, json.dumps(CALL), 16, []),  # inside the name: '{"name": "get_we'
    (NAMED, json.dumps(CALL), 47, [("get_weather", '{"city": "Par')]),
    ("required", PARALLEL_TEXT, 48, [("get_weather", '{"city": "Par')]),
    ("required", PARALLEL_TEXT, 65, [("get_weather", WEATHER_ARGUMENTS)]),  # between calls
    ("required", PARALLEL_TEXT, 99, [("get_weather", WEATHER_ARGUMENTS), ("get_time", "{")]),
]


@pytest.mark.parametrize(("tool_choice", "text", "max_tokens", "calls"), CUT_CALLS)
async def test_a_forced_call_cut_by_max_tokens_comes_back_as_tool_calls(
    client, engine, tool_choice, text, max_tokens, calls
) -> None:
    engine.script_text(text)
    fields = {"tool_choice": tool_choice, "max_tokens": max_tokens}
    body = (await client.post(CHAT, json=tools_body(**fields))).json()
    assert_valid("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["content"] == (None if calls else "")
    functions = [call["function"] for call in message.get("tool_calls", [])]
    assert [(f["name"], f["arguments"]) for f in functions] == calls


async def test_a_forced_call_cut_by_a_stop_string_keeps_finish_reason_stop(client, engine) -> None:
    engine.script_text(json.dumps(CALL))
    body = (await client.post(CHAT, json=tools_body(tool_choice=NAMED, stop=["Paris"]))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"  # not "tool_calls": the call is cut
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "'}


# -- streaming --------------------------------------------------------------------------------


def assemble(chunks: list[dict], index: int = 0) -> tuple[str | None, list[dict], str | None]:
    """(content, calls, finish_reason) of one choice, as the openai SDK accumulates them;
    each call's arguments as the text sent."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for part in delta.get("tool_calls", []):
                if part["index"] not in calls:
                    assert part["id"].startswith("call_") and part["type"] == "function"
                    calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in part and "name" not in part["function"]
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls)))
    return content, ordered, finish


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        (AUTO_TEXT, {}),
        (f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", {}),
        ("Sunny, <no call> here.", {}),
        (json.dumps([CALL, TIME_CALL]), {"tool_choice": "required"}),
        (json.dumps(CALL), {"tool_choice": NAMED}),
        (json.dumps(CALL), {"tool_choice": NAMED, "max_tokens": 5}),
        (json.dumps(CALL), {"tool_choice": NAMED, "max_tokens": 47}),
        (PARALLEL_TEXT, {"tool_choice": "required", "max_tokens": 65}),
        (PARALLEL_TEXT, {"tool_choice": "required", "max_tokens": 99}),
    ],
    ids=[
        "auto-text-and-call",
        "auto-call",
        "auto-text",
        "required",
        "named",
        "named-cut-in-name",
        "named-cut-in-arguments",
        "required-cut-between-calls",
        "required-cut-in-second-call",
    ],
)
async def test_streamed_tool_calls_equal_the_non_streamed(client, engine, text, fields) -> None:
    engine.script_text(text)
    whole = (await client.post(CHAT, json=tools_body(**fields))).json()["choices"][0]
    response = await client.post(CHAT, json=tools_body(stream=True, **fields))
    content, calls, finish = assemble(sse_chunks(response.text))
    assert content == whole["message"]["content"] or (content, whole["message"]["content"]) == (
        None,
        "",
    )
    assert calls == [call["function"] for call in whole["message"].get("tool_calls", [])]
    assert finish == whole["finish_reason"]
