"""Every bad input gets its status and an OpenAI error envelope; none gives a 5xx."""

from __future__ import annotations

import json

import pytest
from fake_engine import Failure
from helpers import chat_body, make_settings, open_client, sse_data
from openai_schemas import assert_valid

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert_valid("ErrorResponse", body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


USER = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ({"messages": USER, "tools": []}, "tools", None),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice", None),
    ({"messages": USER, "functions": []}, "functions", "unsupported_parameter"),
    ({"messages": USER, "audio": {}}, "audio", "unsupported_parameter"),
    ({"messages": USER, "best_of": 2}, "best_of", "unsupported_parameter"),
    (
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
        None,
    ),
    ({}, "messages", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", None),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        None,
    ),
    ({"messages": USER, "stop": 5}, "stop", None),
    ({"messages": USER, "stop": [""]}, "stop", None),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias", None),
    ({"messages": USER, "logit_bias": {"99999": 1}}, "logit_bias", None),
    ({"messages": USER, "logit_bias": {"5": 200}}, "logit_bias", None),
    ({"messages": USER, "stop_token_ids": [99999]}, "stop_token_ids", None),
    ({"messages": USER, "temperature": -1}, "temperature", None),
    ({"messages": USER, "temperature": "hot"}, "temperature", None),
    ({"messages": USER, "top_p": 0}, "top_p", None),
    ({"messages": USER, "top_k": 0}, "top_k", None),
    ({"messages": USER, "min_p": 2}, "min_p", None),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty", None),
    ({"messages": USER, "presence_penalty": 3}, "presence_penalty", None),
    ({"messages": USER, "frequency_penalty": -3}, "frequency_penalty", None),
    ({"messages": USER, "n": 0}, "n", None),
    ({"messages": USER, "n": 1000}, "n", None),
    ({"messages": USER, "seed": -1}, "seed", None),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", None),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", None),
    ({"messages": USER, "max_tokens": 4, "min_tokens": 5}, "min_tokens", None),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", None),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"messages": USER, "stream_options": {"include_obfuscation": True}}, None, None),
    ({"messages": USER, "max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hello " * 300}]}, "messages", None),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_CHAT)
async def test_bad_chat_fields_get_400_naming_the_field(client, body, param, code) -> None:
    if param is None:  # the table's include_obfuscation row: a nested unknown field
        param = "stream_options.include_obfuscation"
    error = assert_error(await client.post(CHAT, json=body), 400, param, code)
    assert error["type"] == "invalid_request_error"


async def test_unknown_field_message_names_it(client) -> None:
    error = assert_error(await client.post(CHAT, json=chat_body(functions=[])), 400, "functions")
    assert error["message"] == "Unrecognized request argument supplied: functions"


async def test_context_window_message_gives_the_token_counts(client, engine) -> None:
    prompt_len = len(engine.tokenizer.apply_chat_template(USER))
    response = await client.post(CHAT, json=chat_body(max_tokens=300))
    error = assert_error(response, 400, "max_tokens", "context_length_exceeded")
    assert "256 tokens" in error["message"]
    assert f"requested {prompt_len + 300} tokens" in error["message"]
    assert f"({prompt_len} in the prompt, 300 for the completion)" in error["message"]
    assert engine.requests == []


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({}, "prompt"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "messages": USER}, "messages"),
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
async def test_bad_completion_fields_get_400(client, engine, body, param) -> None:
    assert_error(await client.post(COMPLETIONS, json=body), 400, param)
    assert engine.requests == []


@pytest.mark.parametrize(
    ("content", "code"),
    [(b"{bad json", "invalid_json"), (b"[]", "invalid_body"), (b"", "invalid_body")],
)
async def test_malformed_bodies_get_400(client, content, code) -> None:
    headers = {"content-type": "application/json"}
    response = await client.post(CHAT, content=content, headers=headers)
    assert_error(response, 400, None, code)


async def test_unknown_model_is_404(client) -> None:
    body = chat_body()
    body["model"] = "gpt-4"
    error = assert_error(await client.post(CHAT, json=body), 404, "model", "model_not_found")
    assert "gpt-4" in error["message"]
    assert_error(await client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


async def test_unknown_route_is_404_and_wrong_method_405(client) -> None:
    assert_error(await client.get("/v1/nothing"), 404, None, "not_found")
    assert_error(await client.get(CHAT), 405, None, "method_not_allowed")


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        ("Basic key-one", 401),
        ("Bearer key-one", 200),
        ("Bearer key-two", 200),
        ("bearer  key-two", 200),
    ],
)
async def test_api_keys(engine, header, status) -> None:
    settings = make_settings(api_keys=("key-one", "key-two"))
    headers = {} if header is None else {"Authorization": header}
    async with open_client(engine, settings) as client:
        response = await client.post(CHAT, json=chat_body(), headers=headers)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
    if status == 401:
        assert_error(response, 401, None, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    else:
        assert response.status_code == 200


async def test_body_over_the_limit_is_413(engine) -> None:
    settings = make_settings(max_body_bytes=2048)
    big = chat_body("x" * 4096)
    async with open_client(engine, settings) as client:
        assert_error(await client.post(CHAT, json=big), 413, None, "request_too_large")

        async def chunked():  # no Content-Length: the bytes are counted as they arrive
            data = json.dumps(big).encode()
            for start in range(0, len(data), 512):
                yield data[start : start + 512]

        response = await client.post(
            CHAT, content=chunked(), headers={"content-type": "application/json"}
        )
        assert "content-length" not in response.request.headers
        assert_error(response, 413, None, "request_too_large")
        assert (await client.post(CHAT, json=chat_body("x" * 100))).status_code == 200
    assert len(engine.requests) == 1


async def test_full_queue_is_429_with_retry_after(client, engine) -> None:
    engine.waiting = 256
    response = await client.post(CHAT, json=chat_body())
    assert_error(response, 429, None, "queue_full")
    assert response.headers["retry-after"] == "1"
    engine.waiting = 255
    assert (await client.post(CHAT, json=chat_body())).status_code == 200


async def test_not_ready_is_503(engine) -> None:
    engine.ready = False
    async with open_client(engine) as client:
        assert_error(await client.post(CHAT, json=chat_body()), 503, None, "not_ready")
        assert_error(await client.get("/v1/models"), 503, None, "not_ready")
        assert_error(await client.get("/ready"), 503, None, "not_ready")
        assert (await client.get("/health")).status_code == 200
    assert engine.requests == []


@pytest.mark.parametrize("as_exception", [False, True])
async def test_engine_fault_is_500_and_the_server_keeps_serving(client, engine, as_exception):
    engine.failure = Failure(after_tokens=2, message="step exploded", as_exception=as_exception)
    error = assert_error(await client.post(CHAT, json=chat_body()), 500, None, "engine_error")
    assert error["type"] == "server_error"
    assert "step exploded" in error["message"]
    engine.failure = None
    response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "stop"


async def test_engine_fault_mid_stream_sends_an_error_event(client, engine) -> None:
    engine.failure = Failure(after_tokens=3, message="step exploded")
    response = await client.post(CHAT, json=chat_body(stream=True))
    assert response.status_code == 200
    payloads = sse_data(response.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])
    assert_valid("ErrorResponse", error)
    assert error["error"]["type"] == "server_error"
    assert "step exploded" in error["error"]["message"]
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world!"
