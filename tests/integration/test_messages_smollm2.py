"""/v1/messages on a real `kvshare serve` (SmolLM2) with the official anthropic SDK: an
agent-style conversation whose every later turn reads its history from the prefix cache
(with a billing line at the start of its system prompt too, stripped by the setting), forced
tool calls whose input validates against their schema, and an aborted stream that frees its
blocks."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.integration.fuzzing import check_after
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

NUM_TURNS = 5
MIN_CACHED_SHARE = 0.95  # cache_read_input_tokens / the previous request's prompt
TOOLS = [
    {
        "name": f"tool_{number}",
        "description": f"Tool {number} reads section {number} of the project notes.",
        "input_schema": {
            "type": "object",
            "properties": {"section": {"enum": [f"s{number}", "all"]}},
            "required": ["section"],
            "additionalProperties": False,
        },
        **({"cache_control": {"type": "ephemeral"}} if number == 19 else {}),
    }
    for number in range(20)
]
# About 3,000 tokens of instructions (SmolLM2's tokenizer), none of them volatile.
SYSTEM = "\n".join(
    f"Rule {number}: when the user asks about module {number}, read its notes first, keep "
    f"answers short, cite the file path and never change files outside the project."
    for number in range(110)
)


def billing_line() -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.197.{secrets.token_hex(2)[:3]};"


@pytest.fixture(scope="module")
def stripping_url() -> Iterator[str]:
    with running_server("--strip-volatile-system-lines") as url:
        yield url


def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def run_conversation(url: str, with_billing_line: bool, num_turns: int = NUM_TURNS) -> list[float]:
    """NUM_TURNS turns of an agent: even turns force a tool call, odd ones answer its result
    (thinking in the history, a breakpoint on the last block, as agents send them); each
    later turn's share of the previous prompt served from the cache."""
    client, model = sdk(url), model_of(url)
    messages: list[dict] = [{"role": "user", "content": "Which section covers module 3?"}]
    shares, previous = [], None
    for turn in range(num_turns):
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        if with_billing_line:  # a new value every request: the worst an agent sends
            system.insert(0, {"type": "text", "text": billing_line()})
        forced = {"type": "tool", "name": f"tool_{turn}"} if turn % 2 == 0 else {"type": "auto"}
        message = client.messages.create(
            model=model,
            max_tokens=24,
            system=system,
            tools=TOOLS,
            tool_choice=forced,
            messages=messages,
            extra_body={"temperature": 0},
        )
        if previous is not None:
            shares.append(message.usage.cache_read_input_tokens / prompt_tokens(previous))
        previous = message.usage
        history = [block.model_dump(exclude_none=True) for block in message.content]
        if turn % 2 == 0:
            call = history[-1]
            assert call["type"] == "tool_use" and message.stop_reason == "tool_use"
            jsonschema.validate(call["input"], TOOLS[turn]["input_schema"])
            history.insert(0, {"type": "thinking", "thinking": "Read it.", "signature": "x"})
            result = {"type": "tool_result", "tool_use_id": call["id"], "content": "Section 3."}
            reply: list[dict] = [result, {"type": "text", "text": "Go on."}]
        else:
            reply = [{"type": "text", "text": f"Now module {turn}?"}]
        reply[-1]["cache_control"] = {"type": "ephemeral"}  # rolling breakpoint
        messages[-1]["content"] = _without_breakpoints(messages[-1]["content"])
        messages += [{"role": "assistant", "content": history}, {"role": "user", "content": reply}]
    return shares


def _without_breakpoints(content):
    if isinstance(content, str):
        return content
    return [{k: v for k, v in block.items() if k != "cache_control"} for block in content]


def test_an_agent_conversation_reads_its_history_from_the_cache(server_url) -> None:
    shares = run_conversation(server_url, with_billing_line=False)
    print("cache_read / previous prompt per turn:", [round(s, 3) for s in shares])
    assert len(shares) == NUM_TURNS - 1
    assert min(shares) >= MIN_CACHED_SHARE, shares


def test_a_billing_line_cannot_defeat_the_cache_when_stripped(stripping_url, server_url) -> None:
    shares = run_conversation(stripping_url, with_billing_line=True)
    print("stripped: cache_read / previous prompt per turn:", [round(s, 3) for s in shares])
    assert min(shares) >= MIN_CACHED_SHARE, shares
    before = scrape(server_url)
    kept = run_conversation(server_url, True, num_turns=2)  # the setting off: misses
    after = scrape(server_url)
    assert max(kept) < 0.1, kept
    reason = 'kvshare_prefix_cache_miss_tokens_total{reason="volatile_prefix"}'
    assert after[reason] > before.get(reason, 0)


def test_forced_tool_input_validates_against_its_schema(server_url) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": schema}]
    client, model = sdk(server_url), model_of(server_url)
    single = {"disable_parallel_tool_use": True}  # one call: a short answer on a CPU
    for choice in ({"type": "any"} | single, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(
            model=model,
            max_tokens=64,
            tools=tools,
            tool_choice=choice,
            messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        )
        assert message.stop_reason == "tool_use", message
        assert {block.type for block in message.content} == {"tool_use"}
        for call in message.content:
            assert call.name == "get_weather"
            jsonschema.validate(call.input, schema)


def test_streamed_events_are_the_sdks_types_and_an_aborted_stream_frees_its_blocks(
    server_url,
) -> None:
    client, model = sdk(server_url), model_of(server_url)
    body = {"model": model, "max_tokens": 40, "stream": True}
    body["messages"] = [{"role": "user", "content": "Tell me about Paris."}]
    events = TypeAdapter(RawMessageStreamEvent)
    with httpx.stream("POST", f"{server_url}/v1/messages", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    kinds = []
    for line in lines:
        event = json.loads(line.removeprefix("data: "))
        kinds.append(event["type"])
        if event["type"] != "ping":
            events.validate_python(event)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    long = {**body, "max_tokens": 2000, "extra_body": None}
    long.pop("extra_body")
    with client.messages.stream(**{k: v for k, v in long.items() if k != "stream"}) as stream:
        for number, _ in enumerate(stream.text_stream):
            if number == 3:
                break  # leaving the block closes the connection mid-answer
    assert check_after(server_url) == []
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": []}]
        )
    assert "messages[0].content" in caught.value.body["error"]["message"]
