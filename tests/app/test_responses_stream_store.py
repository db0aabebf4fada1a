"""Streamed responses and the response store over the FakeEngine: a streamed turn is stored as a
non-streamed one is (GET returns its terminal response, input_items its input), a chain
continues it with the very token ids it ran on and generated, and input_tokens counts a chained
prompt exactly as the create call renders it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers import MODEL
from openai_schemas import assert_valid
from test_responses_stream import parse_events

from engine.core.protocol import FinishReason

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    """Room for chains (the tiny tokenizer spells JSON in bytes)."""
    engine = FakeEngine(tokenizer_dir, max_model_len=4096)
    # "Hello world" spelled in single characters, as a model may generate it (the tokenizer
    # would merge them): a chain that re-tokenized the text would not start with these ids.
    spelled = [engine.tokenizer.encode(c, False)[0] for c in "Hello world"]
    assert engine.tokenizer.encode("Hello world", False) != spelled
    generated = [*spelled, engine.eos_token_id]
    engine.script = lambda params, index: (generated, FinishReason.STOP, engine.eos_token_id)
    return engine


async def streamed(client, **fields) -> dict:
    """The terminal event's response of a streamed create."""
    body = {"model": MODEL, **fields, "stream": True}
    response = await client.post(RESPONSES, json=body)
    assert response.status_code == 200, response.text
    events = parse_events(response.text)
    assert events[-1]["type"] == "response.completed"
    return events[-1]["response"]


async def created(client, **fields) -> dict:
    response = await client.post(RESPONSES, json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_streamed_response_is_stored_as_its_terminal_event_says(client) -> None:
    final = await streamed(client, input="one", metadata={"k": "v"})
    assert final["store"] is True
    got = await client.get(f"{RESPONSES}/{final['id']}")
    assert got.status_code == 200
    assert got.json() == final
    assert_valid("Response", got.json())
    items = (await client.get(f"{RESPONSES}/{final['id']}/input_items")).json()
    assert_valid("ResponseItemList", items)
    assert [item["content"] for item in items["data"]] == [[{"type": "input_text", "text": "one"}]]


async def test_a_streamed_response_with_store_false_is_not_kept(client) -> None:
    final = await streamed(client, input="one", store=False)
    assert final["store"] is False
    assert (await client.get(f"{RESPONSES}/{final['id']}")).status_code == 404


@pytest.mark.parametrize("stream_first", [True, False])
async def test_a_streamed_turn_chains_as_a_created_one(client, engine, stream_first) -> None:
    """Both turns' prompts are the same token ids whichever of the two turns streamed, and the
    second starts with the first's prompt and generated ids (EOS included)."""
    first = await created(client, input="one")
    await created(client, input="two", previous_response_id=first["id"])
    make_first = streamed if stream_first else created
    make_second = created if stream_first else streamed
    again = await make_first(client, input="one")
    second = await make_second(client, input="two", previous_response_id=again["id"])
    assert second["previous_response_id"] == again["id"]
    prompts = [request.prompt_token_ids for request in engine.requests]
    assert prompts[2:] == prompts[:2]
    generated = engine.script(None, 0)[0]
    assert prompts[3][: len(prompts[2]) + len(generated)] == prompts[2] + generated
    items = (await client.get(f"{RESPONSES}/{second['id']}/input_items?order=asc")).json()
    texts = [item["content"][0]["text"] for item in items["data"]]
    assert texts == ["one", "Hello world", "two"]


async def test_an_unknown_previous_response_id_refuses_the_stream(client, engine) -> None:
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_nope", "stream": True}
    response = await client.post(RESPONSES, json=body)
    assert response.status_code == 404
    assert_valid("ErrorResponse", response.json())
    assert response.json()["error"]["param"] == "previous_response_id"
    assert engine.requests == []


async def test_input_tokens_counts_the_chained_prompt(client, engine) -> None:
    first = await created(client, input="one", instructions="be brief")
    fields = {"input": "two", "instructions": "be brief", "previous_response_id": first["id"]}
    counted = await client.post(f"{RESPONSES}/input_tokens", json=fields)
    assert counted.status_code == 200, counted.text
    assert_valid("TokenCountsResource", counted.json())
    assert len(engine.requests) == 1  # counting generates nothing
    second = await created(client, **fields)
    num_prompt_tokens = len(engine.requests[1].prompt_token_ids)
    assert counted.json()["input_tokens"] == num_prompt_tokens
    assert second["usage"]["input_tokens"] == num_prompt_tokens
    unchained = await client.post(f"{RESPONSES}/input_tokens", json={"input": "two"})
    assert unchained.json()["input_tokens"] < num_prompt_tokens


async def test_input_tokens_scopes_the_chain_like_create(client) -> None:
    first = await created(client, input="one", cache_salt="s1")
    for fields, status in (
        ({"previous_response_id": "resp_nope"}, 404),
        ({"previous_response_id": first["id"]}, 404),  # without its cache_salt
        ({"previous_response_id": first["id"], "cache_salt": "s2"}, 404),
        ({"previous_response_id": first["id"], "cache_salt": "s1"}, 200),
    ):
        counted = await client.post(f"{RESPONSES}/input_tokens", json={"input": "x", **fields})
        assert counted.status_code == status, (fields, counted.text)
        if status == 404:
            assert counted.json()["error"]["param"] == "previous_response_id"
