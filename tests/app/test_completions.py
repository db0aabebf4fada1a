"""POST /v1/completions over the FakeEngine."""

from __future__ import annotations

import pytest
from fake_engine import Failure, FakeEngine
from helpers import MODEL, sse_chunks, streamed_text
from openai_schemas import assert_valid
from tiny_tokenizer import FAKE_TEXTS

pytestmark = pytest.mark.anyio

URL = "/v1/completions"


async def test_response_has_the_openai_shape(client, engine: FakeEngine) -> None:
    response = await client.post(URL, json={"model": MODEL, "prompt": "Hello"})
    assert response.status_code == 200
    body = response.json()
    assert_valid("CreateCompletionResponse", body)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": FAKE_TEXTS[0], "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_ids = engine.tokenizer.encode("Hello")
    script_ids, _, _ = engine.script(engine.requests[0].sampling_params, 0)
    assert engine.requests[0].prompt_token_ids == prompt_ids
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(script_ids)


async def test_token_id_prompt_goes_to_the_engine_as_is(client, engine) -> None:
    response = await client.post(URL, json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert response.status_code == 200
    assert engine.requests[0].prompt_token_ids == [5, 6, 7]
    assert response.json()["usage"]["prompt_tokens"] == 3


async def test_several_prompts_times_n_choices(client, engine) -> None:
    body = {"prompt": ["Hello", "Hi there"], "n": 2, "seed": 0, "max_tokens": 3}
    whole = (await client.post(URL, json=body)).json()
    assert_valid("CreateCompletionResponse", whole)
    first = [r.request_id for r in engine.requests]
    assert first == [whole["id"] + "-0", whole["id"] + "-1"]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    three = [engine.tokenizer.decode(engine.tokenizer.encode(t, False)[:3]) for t in FAKE_TEXTS]
    assert [c["text"] for c in whole["choices"]] == [three[0], three[1], three[0], three[1]]
    prompt_lens = [len(engine.tokenizer.encode(p)) for p in body["prompt"]]
    assert [len(r.prompt_token_ids) for r in engine.requests] == prompt_lens
    assert whole["usage"]["prompt_tokens"] == sum(prompt_lens)
    assert whole["usage"]["completion_tokens"] == 12
    streamed = sse_chunks((await client.post(URL, json={**body, "stream": True})).text)
    for index in range(4):
        assert streamed_text(streamed, index, key="text") == whole["choices"][index]["text"]


async def test_echo_prepends_the_prompt(client) -> None:
    body = {"prompt": "Hi there", "echo": True, "max_tokens": 2}
    whole = (await client.post(URL, json=body)).json()
    assert whole["choices"][0]["text"] == "Hi there" + "Hello world"
    chunks = sse_chunks((await client.post(URL, json={**body, "stream": True})).text)
    assert chunks[0]["choices"][0]["text"] == "Hi there"
    assert streamed_text(chunks, key="text") == whole["choices"][0]["text"]


async def test_logprobs_have_the_completions_shape(client, engine: FakeEngine) -> None:
    body = {"prompt": "Hello", "logprobs": 2, "max_tokens": 4}
    whole = (await client.post(URL, json=body)).json()
    assert_valid("CreateCompletionResponse", whole)
    logprobs = whole["choices"][0]["logprobs"]
    script_ids, _, _ = engine.script(engine.requests[0].sampling_params, 0)
    names = [engine.tokenizer.token_text(t) for t in script_ids[:4]]
    assert names == ["Hello", " world", "!", " "]
    assert logprobs["tokens"] == names
    assert logprobs["token_logprobs"] == [-0.25, -0.5, -0.75, -1.0]
    assert logprobs["text_offset"] == [0, 5, 11, 12]
    neighbour = engine.tokenizer.token_text(script_ids[0] + 1)
    assert logprobs["top_logprobs"][0] == {"Hello": -0.25, neighbour: -1.25}
    chunks = sse_chunks((await client.post(URL, json={**body, "stream": True})).text)
    streamed_offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed_offsets == logprobs["text_offset"]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string(client, engine, stream) -> None:
    body = {"prompt": "Hello", "stop": ["brown"], "stream": stream}
    response = await client.post(URL, json=body)
    if stream:
        chunks = sse_chunks(response.text)
        text, finish_reason = streamed_text(chunks, key="text"), chunks[-1]["choices"][0]
        finish_reason = finish_reason["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, finish_reason = choice["text"], choice["finish_reason"]
    assert text == FAKE_TEXTS[0][: FAKE_TEXTS[0].index("brown")]
    assert finish_reason == "stop"
    assert engine.aborts == [(engine.requests[0].request_id, 0)]


async def test_include_usage(client) -> None:
    body = {"prompt": "Hello", "max_tokens": 3}
    whole = (await client.post(URL, json=body)).json()
    options = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks((await client.post(URL, json={**body, **options})).text)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert streamed_text(chunks, key="text") == whole["choices"][0]["text"]


async def test_a_failure_in_one_of_several_prompts_fails_the_request(client, engine) -> None:
    engine.failure = Failure(after_tokens=1, message="boom")
    response = await client.post(URL, json={"prompt": ["Hello", "Hi"], "max_tokens": 5})
    assert response.status_code == 500
    assert "boom" in response.json()["error"]["message"]
    assert sorted(engine.closed) == sorted(r.request_id for r in engine.requests)
