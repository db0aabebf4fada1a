"""POST /v1/responses/input_tokens, /tokenize and /detokenize over the FakeEngine: the counts
are the prompts the generation routes feed the engine, and nothing reaches the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers import MODEL, make_settings, open_client
from openai_schemas import assert_valid

pytestmark = pytest.mark.anyio

TOOLS = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
]
ITEMS = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "time?"}]},
    {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "noon"},
]


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(tokenizer_dir, max_model_len=4096)


@pytest.mark.parametrize(
    "fields",
    [
        {"input": "hi"},
        {"input": "hi", "instructions": "be brief"},
        {"input": ITEMS, "tools": TOOLS, "tool_choice": "auto"},
    ],
)
async def test_input_tokens_are_the_prompt_the_response_gets(client, engine, fields) -> None:
    counted = await client.post("/v1/responses/input_tokens", json={"model": MODEL, **fields})
    assert counted.status_code == 200, counted.text
    assert_valid("TokenCountsResource", counted.json())
    assert engine.requests == []  # counting generates nothing
    served = await client.post("/v1/responses", json={"model": MODEL, **fields})
    prompt_token_ids = engine.requests[0].prompt_token_ids
    assert counted.json() == {
        "object": "response.input_tokens",
        "input_tokens": len(prompt_token_ids),
    }
    assert served.json()["usage"]["input_tokens"] == len(prompt_token_ids)


async def test_input_tokens_without_model_counts_for_the_served_one(client, engine) -> None:
    counted = await client.post("/v1/responses/input_tokens", json={"input": "hi"})
    expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert counted.json()["input_tokens"] == len(expected)


async def test_tokenize_a_prompt_as_completions_do(client, engine) -> None:
    response = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    tokens = engine.tokenizer.encode("Hello world")
    assert response.json() == {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world"})
    assert engine.requests[0].prompt_token_ids == tokens
    body = {"prompt": "Hi", "add_special_tokens": False, "return_token_strs": True}
    plain = (await client.post("/tokenize", json=body)).json()
    assert plain["tokens"] == engine.tokenizer.encode("Hi", False)
    assert plain["token_strs"] == [engine.tokenizer.token_text(t) for t in plain["tokens"]]


async def test_tokenize_messages_as_chat_does(client, engine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": messages, "tools": CHAT_TOOLS}
    response = await client.post("/tokenize", json=body)
    await client.post("/v1/chat/completions", json=body)
    assert response.json()["tokens"] == engine.requests[0].prompt_token_ids
    open_turn = {"messages": messages, "add_generation_prompt": False}
    without = (await client.post("/tokenize", json=open_turn)).json()["tokens"]
    assert without == engine.tokenizer.apply_chat_template(messages, False)


async def test_detokenize_inverts_tokenize(client, engine) -> None:
    text = "Hello world! 你好 🙂"
    tokens = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
    response = await client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.json() == {"prompt": engine.tokenizer.decode(tokens, False)}
    assert response.json()["prompt"].endswith(text)


async def test_counting_is_not_queued(engine: FakeEngine) -> None:
    engine.waiting = 10**6  # a full queue: generation gets 429, counting does not wait on it
    async with open_client(engine) as client:
        full = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert full.status_code == 429
        counted = await client.post("/v1/responses/input_tokens", json={"input": "hi"})
        assert counted.status_code == 200


async def test_api_keys_guard_tokenize_and_detokenize(engine: FakeEngine) -> None:
    async with open_client(engine, make_settings(api_keys=("k1",))) as client:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert (await client.post(path, json=body)).status_code == 401
            keyed = await client.post(path, json=body, headers={"Authorization": "Bearer k1"})
            assert keyed.status_code == 200


BAD_INPUT = [
    ("/v1/responses/input_tokens", {"model": MODEL}, "input"),
    ("/v1/responses/input_tokens", {"input": 5}, "input"),
    ("/v1/responses/input_tokens", {"input": [{"type": "image"}]}, "input[0].type"),
    ("/v1/responses/input_tokens", {"input": "hi", "max_output_tokens": 16}, "max_output_tokens"),
    (
        "/v1/responses/input_tokens",
        {"input": "hi", "tools": [{"type": "web_search"}]},
        "tools[0].type",
    ),
    (
        "/v1/responses/input_tokens",
        {"input": "hi", "text": {"format": {"type": "json_schema"}}},
        "text.format",
    ),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
        "add_special_tokens",
    ),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [0, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUT)
async def test_bad_input_is_a_400_naming_the_field(client, path, body, param) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/responses/input_tokens", "/tokenize", "/detokenize"])
async def test_an_unknown_model_is_a_404(client, path) -> None:
    body = {"model": "nope", "input": "hi", "prompt": "hi", "tokens": [1]}
    fields = {"/v1/responses/input_tokens": ("model", "input"), "/tokenize": ("model", "prompt")}
    body = {k: body[k] for k in fields.get(path, ("model", "tokens"))}
    response = await client.post(path, json=body)
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


async def test_openapi_declares_the_counting_routes_and_their_statuses(client) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    for path in ("/v1/responses/input_tokens", "/tokenize", "/detokenize"):
        statuses = set(paths[path]["post"]["responses"])
        assert statuses == {"200", "400", "404", "413", "500", "503"}, path
