"""The Responses API driven by the official `openai` SDK and the OpenAI Agents SDK against a
real `kvshare serve` of the embedded default (one server for the module; short, seeded
answers). Events are checked against the spec's schemas (tests/app/openai_schemas.json, a
subset of OpenAI's openapi.yaml), token counts against the HF tokenizer."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.app.openai_schemas import VENDORED, assert_valid
from tests.integration.fuzzing import check_after
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

SHORT = 24  # max_output_tokens of the plain answers
BLOCK_SIZE = 16  # config/cpu.yaml's kv block_size
ASK = "Name a colour of the sky."
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
WEATHER_ASK = "What is the weather in Paris?"


class Sky(enum.StrEnum):
    blue = "blue"
    grey = "grey"


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sky: Sky


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server() as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _event_schemas() -> dict[str, str]:
    schemas = json.loads(VENDORED.read_text())["schemas"]
    names = [m["$ref"].rsplit("/", 1)[-1] for m in schemas["ResponseStreamEvent"]["anyOf"]]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


def _without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """What two calls of the same seeded request share: not ids, times, cache hits."""
    output = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]
    ]
    drop = ("id", "created_at", "completed_at")
    usage = {k: v for k, v in response["usage"].items() if k != "input_tokens_details"}
    same = {k: v for k, v in response.items() if k not in drop}
    return same | {"output": output, "usage": usage}  # the second call hits the cache


def _stream_events(client: openai.OpenAI, **request: Any) -> tuple[list[dict], dict]:
    """Every event of responses.stream (as sent: unset fields left out), each valid against
    its member of the spec's ResponseStreamEvent; numbered 0.., one terminal event, last.
    Also the terminal event's response (the SDK's get_final_response() wants a
    response.completed, so a response.incomplete stream cannot use it)."""
    schemas = _event_schemas()
    with client.responses.stream(**request) as stream:
        events = [_as_sent(event.to_dict(mode="json")) for event in stream]
    for event in events:
        assert_valid(schemas[event["type"]], event)
        assert_valid("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] in TERMINAL for e in events] == [False] * (len(events) - 1) + [True]
    return events, events[-1]["response"]


def _as_sent(node: Any) -> Any:
    """The SDK's event without the `parsed` fields its stream helper adds."""
    if isinstance(node, list):
        return [_as_sent(item) for item in node]
    if isinstance(node, dict):
        return {k: _as_sent(v) for k, v in node.items() if k != "parsed"}
    return node


def test_create_with_a_string_input(client, model) -> None:
    response = client.responses.create(
        model=model, input=ASK, max_output_tokens=SHORT, temperature=0, extra_body={"seed": 1}
    )
    assert_valid("Response", response.to_dict(mode="json"))
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens <= SHORT


def test_create_with_items_and_instructions(client, model) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
        {"type": "message", "role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": ASK},
    ]
    response = client.responses.create(
        model=model, input=items, instructions="Answer in one word.", max_output_tokens=SHORT
    )
    assert_valid("Response", response.to_dict(mode="json"))
    assert response.instructions == "Answer in one word."
    assert response.output[0].type == "message" and response.output_text


def test_stream_events_and_the_same_response_as_create(client, model) -> None:
    request = {"model": model, "input": ASK, "max_output_tokens": SHORT, "extra_body": {"seed": 3}}
    events, final = _stream_events(client, **request)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    closing = ["response.output_text.done", "response.content_part.done"]
    assert kinds[-4:-1] == [*closing, "response.output_item.done"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == final["output"][0]["content"][0]["text"] == events[-4]["text"]
    assert events[-1]["type"] == f"response.{final['status']}"
    created = client.responses.create(**request).to_dict(mode="json")
    assert _without_ids(final) == _without_ids(created)


def test_stream_cut_by_max_output_tokens_ends_incomplete(client, model) -> None:
    request = {"model": model, "input": "Write a long story about the sea."}
    events, final = _stream_events(client, **request, max_output_tokens=16, extra_body={"seed": 4})
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 16


def test_stream_a_forced_call_as_function_call_events(client, model) -> None:
    request = {"model": model, "input": WEATHER_ASK, "tools": [WEATHER], "tool_choice": "required"}
    events, final = _stream_events(
        client, **request, parallel_tool_calls=False, max_output_tokens=48
    )
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final["output"]
    assert events[4]["arguments"] == call["arguments"] == events[3]["delta"]
    assert json.loads(call["arguments"])["city"] in CITY["enum"]


def test_a_client_that_leaves_mid_stream_frees_its_request(url, model) -> None:
    body = {"model": model, "input": "Write a long story about the sea.", "stream": True}
    body["max_output_tokens"] = 2000  # minutes of decoding: only an abort ends it in time
    aborts = 'kvshare_requests_total{finish_reason="abort"}'
    before = scrape(url).get(aborts, 0)
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and "response.output_text.delta" in line:
                break  # leave with the answer under way
    assert check_after(url) == []  # nothing running, no private block, nothing leaked
    assert scrape(url)[aborts] == before + 1


def test_parse_with_a_pydantic_model(client, model) -> None:
    response = client.responses.parse(
        model=model,
        input="Is the sky blue? Answer as JSON.",
        text_format=Verdict,
        max_output_tokens=40,
        temperature=0,
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Verdict)
    assert Verdict.model_validate_json(response.output_text) == response.output_parsed


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize(
    "tool_choice", ["none", "auto", "required", {"type": "function", "name": "get_weather"}]
)
def test_function_tools_with_each_tool_choice(client, model, tool_choice) -> None:
    response = client.responses.create(
        model=model,
        input=WEATHER_ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    assert_valid("Response", response.to_dict(mode="json"))
    calls = _calls(response)
    if tool_choice == "none":
        assert calls == [] and response.output_text
    elif tool_choice != "auto":
        assert len(calls) == 1 and response.status == "completed"
        if isinstance(tool_choice, dict):
            assert calls[0].name == "get_weather"
    for call in calls:  # the grammar holds the arguments to the tool's schema
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            assert set(arguments) == {"city"} and arguments["city"] in CITY["enum"]


def test_a_function_call_output_round_trip(client, model) -> None:
    first = client.responses.create(
        model=model,
        input=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    (call,) = _calls(first)
    reply = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    items = [{"role": "user", "content": WEATHER_ASK}, call.to_dict(), reply]
    second = client.responses.create(
        model=model, input=items, tools=[WEATHER], max_output_tokens=SHORT, temperature=0
    )
    assert second.output_text and second.status in ("completed", "incomplete")
    unknown = {**reply, "call_id": "call_nope"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=[items[0], unknown], max_output_tokens=SHORT)
    assert refused.value.body["param"] == "input[1].call_id"


def test_store_false_is_echoed(client, model) -> None:
    response = client.responses.create(
        model=model, input=ASK, store=False, max_output_tokens=16, temperature=0
    )
    assert response.store is False and response.status in ("completed", "incomplete")


def test_input_tokens_are_the_prompt_tokens_of_the_same_request(client, model) -> None:
    request = {
        "model": model,
        "input": [{"role": "user", "content": WEATHER_ASK}],
        "instructions": "Be brief.",
        "tools": [WEATHER],
    }
    counted = client.responses.input_tokens.count(**request)
    assert counted.object == "response.input_tokens"
    served = client.responses.create(**request, max_output_tokens=16, temperature=0)
    assert counted.input_tokens == served.usage.input_tokens


def test_tokenize_and_detokenize_agree_with_the_hf_tokenizer(url, model, model_dir) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    text = "The quick brown fox, 你好 🙂"
    messages = [{"role": "user", "content": text}]
    with httpx.Client(base_url=url, timeout=60) as http:
        prompt = http.post("/tokenize", json={"model": model, "prompt": text}).json()
        chat = http.post("/tokenize", json={"model": model, "messages": messages}).json()
        back = http.post("/detokenize", json={"model": model, "tokens": chat["tokens"]}).json()
    assert prompt["tokens"] == hf.encode(text) and prompt["count"] == len(prompt["tokens"])
    assert prompt["max_model_len"] > 0
    assert chat["tokens"] == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert back["prompt"] == hf.decode(chat["tokens"])


def test_agents_sdk_runner_with_the_default_responses_model(url, model) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    cities: list[str] = []
    bodies: list[dict] = []

    async def record(request) -> None:
        bodies.append(json.loads(request.content))

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}."

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]})
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
    )
    agent = Agent(
        name="forecaster",
        instructions="Use the tool, then answer in one sentence.",
        model=OpenAIResponsesModel(model=model, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=0
        ),
    )
    result = asyncio.run(Runner.run(agent, WEATHER_ASK, max_turns=4))
    assert len(cities) >= 1 and result.final_output
    # No conversation id: each turn sends the whole input, the call and its output included.
    assert all(body.get("previous_response_id") is None for body in bodies)
    second = bodies[1]["input"]
    assert [item.get("type") for item in second[-2:]] == ["function_call", "function_call_output"]


def test_nothing_leaked(url) -> None:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert "kvshare_kv_blocks_leaked 0.0" in metrics


def test_a_streamed_response_is_stored_and_continued(client, url, model) -> None:
    """A streamed turn is kept as its terminal event says; a streamed continuation of it is
    the chain a non-streamed one is (same prompt, same answer), served from the prefix cache,
    and input_tokens counts that chained prompt."""
    request = {"model": model, "max_output_tokens": SHORT, "temperature": 0}
    _, first = _stream_events(client, **request, input=ASK, extra_body={"seed": 5})
    assert first["store"] is True
    assert httpx.get(f"{url}/v1/responses/{first['id']}", timeout=30).json() == first
    follow = {**request, "input": "And at night?", "previous_response_id": first["id"]}
    counted = client.responses.input_tokens.count(
        model=model, input=follow["input"], previous_response_id=first["id"]
    )
    _, second = _stream_events(client, **follow, extra_body={"seed": 6})
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] == counted.input_tokens
    # Every full block of what the first turn computed (all but its last generated token):
    # the chain starts with exactly those ids, so the radix tree matches them.
    computed = first["usage"]["input_tokens"] + first["usage"]["output_tokens"] - 1
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= computed // BLOCK_SIZE * BLOCK_SIZE
    unstreamed = client.responses.create(**follow, extra_body={"seed": 6}).to_dict(mode="json")
    assert _without_ids(second) == _without_ids(unstreamed)
    items = client.responses.input_items.list(second["id"], order="asc")
    assert [item.type for item in items.data] == ["message"] * 3
    assert items.data[1].content[0].text == first["output"][0]["content"][0]["text"]
    assert check_after(url) == []
