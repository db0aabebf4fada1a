"""/v1/messages on a real `kvshare serve` (SmolLM2) with the official anthropic SDK: an
agent-style conversation (benchmarks/anthropic_agent.py's) whose every later turn reads its
history from the prefix cache (with a billing line at the start of its system prompt too,
stripped by the setting), forced tool calls whose input validates against their schema, and
an aborted stream that frees its blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from benchmarks.anthropic_agent import GOAL as MIN_CACHED_SHARE
from benchmarks.anthropic_agent import NUM_TURNS, billing_line, run_conversation
from tests.integration.fuzzing import check_after
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stripping_url() -> Iterator[str]:
    # the default quantized weights: a faster prefill, and the exact mode is not needed here
    with running_server("--strip-volatile-system-lines", "--quantization", "native") as url:
        yield url


def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def shares_of(url: str, with_billing_line: bool, num_turns: int = NUM_TURNS) -> list[float]:
    """Each later turn's cache_read_input_tokens / the previous turn's prompt."""
    turns = run_conversation(url, with_billing_line, num_turns)
    return [turn.cached_share for turn in turns[1:]]


def test_an_agent_conversation_reads_its_history_from_the_cache(server_url) -> None:
    shares = shares_of(server_url, with_billing_line=False)
    print("cache_read / previous prompt per turn:", [round(s, 3) for s in shares])
    assert len(shares) == NUM_TURNS - 1
    assert min(shares) >= MIN_CACHED_SHARE, shares


def test_a_billing_line_cannot_defeat_the_cache_when_stripped(stripping_url) -> None:
    shares = shares_of(stripping_url, with_billing_line=True)
    print("stripped: cache_read / previous prompt per turn:", [round(s, 3) for s in shares])
    assert min(shares) >= MIN_CACHED_SHARE, shares


def test_a_kept_billing_line_is_counted_as_the_reason_of_the_miss(server_url) -> None:
    """The setting off: a line that changes makes the next request miss right after it,
    and the metric says why."""
    client, model = sdk(server_url), model_of(server_url)
    reason = 'kvshare_prefix_cache_miss_tokens_total{reason="volatile_prefix"}'
    before = scrape(server_url).get(reason, 0)
    rules = "\n".join(f"Rule {number}: be brief and exact." for number in range(12))
    reads = []
    for _ in range(2):
        system = [{"type": "text", "text": billing_line()}, {"type": "text", "text": rules}]
        message = client.messages.create(
            model=model, max_tokens=4, system=system, messages=[{"role": "user", "content": "Hi"}]
        )
        reads.append(message.usage.cache_read_input_tokens)
    assert reads[1] < 32, reads  # at most the block or two before the hash
    assert scrape(server_url)[reason] > before


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
