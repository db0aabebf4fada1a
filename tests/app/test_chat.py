"""POST /v1/chat/completions over the FakeEngine: shapes, streaming, stop strings, logprobs."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from helpers import MODEL, chat_body, make_settings, open_client, sse_chunks, streamed_text
from openai_schemas import assert_valid
from tiny_tokenizer import FAKE_TEXTS

from engine.core.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_response_has_the_openai_shape(client, engine: FakeEngine) -> None:
    engine.num_cached_tokens = 5
    response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    body = response.json()
    assert_valid("CreateChatCompletionResponse", body)
    prompt_ids = engine.tokenizer.apply_chat_template(MESSAGES)
    script_ids, _, _ = engine.script(engine.requests[0].sampling_params, 0)
    assert engine.requests[0].prompt_token_ids == prompt_ids
    assert body["id"] == engine.requests[0].request_id
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["system_fingerprint"].startswith("fp_")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": FAKE_TEXTS[0], "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(script_ids),
        "total_tokens": len(prompt_ids) + len(script_ids),
        "prompt_tokens_details": {"cached_tokens": 5},
    }
    assert engine.aborts == []


@pytest.mark.parametrize(
    "fields",
    [{}, {"max_tokens": 5}, {"n": 3, "seed": 4}, {"seed": 1}, {"stop": ["lazy"]}],
    ids=["eos", "length", "n3", "multibyte", "stop"],
)
async def test_streamed_text_equals_the_non_streamed_text(client, fields: dict) -> None:
    whole = (await client.post("/v1/chat/completions", json=chat_body(**fields))).json()
    response = await client.post("/v1/chat/completions", json=chat_body(stream=True, **fields))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
        assert "usage" not in chunk
        assert len({chunk["id"] for chunk in chunks}) == 1
    for choice in whole["choices"]:
        index = choice["index"]
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert streamed_text(chunks, index) == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


async def test_include_usage_adds_a_last_chunk_with_usage(client) -> None:
    whole = (await client.post("/v1/chat/completions", json=chat_body())).json()
    options = {"stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=chat_body(**options))
    chunks = sse_chunks(response.text)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)


async def test_multibyte_characters_are_never_split(client, engine: FakeEngine) -> None:
    script_ids, _, _ = engine.script(SamplingParams(seed=1, max_tokens=100), 0)
    pieces = [engine.tokenizer.decode([token_id]) for token_id in script_ids]
    assert any("\ufffd" in piece for piece in pieces), "the test needs a split character"
    response = await client.post("/v1/chat/completions", json=chat_body(seed=1, stream=True))
    chunks = sse_chunks(response.text)
    contents = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert not any("\ufffd" in content for content in contents)
    assert "".join(contents) == FAKE_TEXTS[1]
    assert "龘" in contents  # released as one piece once its last byte arrived


async def test_n_choices_with_a_seed_are_reproducible(client, engine: FakeEngine) -> None:
    body = chat_body(n=3, seed=7)
    first = (await client.post("/v1/chat/completions", json=body)).json()
    again = (await client.post("/v1/chat/completions", json=body)).json()
    texts = [choice["message"]["content"] for choice in first["choices"]]
    assert texts == [FAKE_TEXTS[(7 + i) % 3] for i in range(3)]
    assert [c["message"]["content"] for c in again["choices"]] == texts
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert engine.requests[0].sampling_params.n == 3
    assert engine.requests[0].sampling_params.seed == 7


def _no_single_token_contains(engine: FakeEngine, text: str, stop: str) -> bool:
    ids = engine.tokenizer.encode(text, False)
    return stop in text and all(stop not in engine.tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_cuts_and_aborts(client, engine, stream) -> None:
    assert _no_single_token_contains(engine, FAKE_TEXTS[0], "o wor")
    response = await client.post(
        "/v1/chat/completions", json=chat_body(stop="o wor", stream=stream)
    )
    if stream:
        chunks = sse_chunks(response.text)
        text = streamed_text(chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = response.json()["choices"][0]
        text, finish_reason = choice["message"]["content"], choice["finish_reason"]
        assert finish_reason == "stop"
    assert text == "Hell"
    assert engine.aborts == [(engine.requests[0].request_id, 0)]


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["lazy cat"], FAKE_TEXTS[0]),  # a prefix matched, then diverged: all text comes out
        (["fox", "quick"], FAKE_TEXTS[0][: FAKE_TEXTS[0].index(" quick")] + " "),
        (["🙂"], FAKE_TEXTS[0][: FAKE_TEXTS[0].index("🙂")]),
        (["dog."], FAKE_TEXTS[0][: FAKE_TEXTS[0].index("dog.")]),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_table(client, stop, expected, stream) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(stop=stop, stream=stream))
    if stream:
        text = streamed_text(sse_chunks(response.text))
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text == expected


async def test_stop_string_ends_only_the_choice_that_hit_it(client, engine) -> None:
    # seed 0: choice 0 says FAKE_TEXTS[0], choice 1 says FAKE_TEXTS[1] ("Rare 龘 and ...").
    body = chat_body(n=2, seed=0, stop=[" and"])
    choices = (await client.post("/v1/chat/completions", json=body)).json()["choices"]
    assert choices[0]["message"]["content"] == FAKE_TEXTS[0]
    assert choices[1]["message"]["content"] == "Rare 龘"
    assert [c["finish_reason"] for c in choices] == ["stop", "stop"]
    assert engine.aborts == [(engine.requests[0].request_id, 1)]


async def test_logprobs_have_the_chat_shape(client, engine: FakeEngine) -> None:
    body = chat_body(logprobs=True, top_logprobs=2, max_tokens=4)
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    assert_valid("CreateChatCompletionResponse", whole)
    content = whole["choices"][0]["logprobs"]["content"]
    script_ids, _, _ = engine.script(engine.requests[0].sampling_params, 0)
    assert [entry["token"] for entry in content] == [
        engine.tokenizer.token_text(t) for t in script_ids[:4]
    ]
    assert [entry["logprob"] for entry in content] == [-0.25, -0.5, -0.75, -1.0]
    assert content[0]["bytes"] == list(engine.tokenizer.token_bytes(script_ids[0]))
    assert [len(entry["top_logprobs"]) for entry in content] == [2, 2, 2, 2]
    assert content[0]["top_logprobs"][0] == {
        k: content[0][k] for k in ("token", "logprob", "bytes")
    }
    assert whole["choices"][0]["logprobs"]["refusal"] is None
    streamed = sse_chunks(
        (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
    )
    streamed_content = [e for c in streamed[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed_content == content


async def test_default_max_tokens_is_the_room_left_capped(tokenizer_dir) -> None:
    prompt_len = len(FakeEngine(tokenizer_dir).tokenizer.apply_chat_template(MESSAGES))
    for cap, expected in [(None, 40 - prompt_len), (5, 5)]:
        engine = FakeEngine(tokenizer_dir, max_model_len=40)
        async with open_client(engine, make_settings(default_max_tokens=cap)) as client:
            response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 200
        assert engine.requests[0].sampling_params.max_tokens == expected


async def test_max_completion_tokens_wins_over_max_tokens(client, engine) -> None:
    body = chat_body(max_tokens=9, max_completion_tokens=3)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert engine.requests[0].sampling_params.max_tokens == 3


async def test_request_fields_reach_the_engine(client, engine) -> None:
    body = chat_body(
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop=["zzz"],
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"5": -100, "7": 2.5},
        top_k=20,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[9],
        cache_salt="tenant-a",
        user="someone",
    )
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    request = engine.requests[0]
    assert request.cache_salt == "tenant-a"
    assert request.sampling_params == SamplingParams(
        n=2,
        max_tokens=8,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={5: -100.0, 7: 2.5},
        seed=3,
        stop=("zzz",),
        stop_token_ids=(9,),
        ignore_eos=True,
        logprobs=None,
    )


async def test_content_parts_and_developer_role(client, engine) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    )
    assert engine.requests[0].prompt_token_ids == expected


async def test_null_flags_mean_their_defaults(client, engine) -> None:
    body = chat_body(stream=None, logprobs=None, ignore_eos=None, temperature=None, stop=None)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["logprobs"] is None
    room = 256 - len(engine.requests[0].prompt_token_ids)  # max_model_len - prompt
    assert engine.requests[0].sampling_params == SamplingParams(max_tokens=room)
