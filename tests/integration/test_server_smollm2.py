"""The HTTP API end to end: real uvicorn, real engine on SmolLM2, the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.integration.server import scrape

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_streamed_text_equals_non_streamed_and_usage_arrives(client, model):
    full = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=24
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert text  # the model said something
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(server_url, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "chat.completion.chunk" for line in lines[:-1])


@pytest.mark.parametrize(
    "prompt", ["你好，世界！你好，世界！你好，世界！你好，", "😀🎉😀🎉😀🎉😀🎉😀"]
)
def test_unicode_streams_without_replacement_characters(client, model, prompt):
    # Greedy continuations of these repeat CJK / emoji, whose bytes span several tokens.
    params = dict(model=model, prompt=prompt, temperature=0, max_tokens=16)
    full = client.completions.create(**params).choices[0].text
    stream = client.completions.create(**params, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == full
    assert all("\ufffd" not in piece for piece in pieces)
    assert sum(ord(ch) > 0x2E80 for ch in full) >= 3  # CJK / emoji made it through


def test_n3_seeded_is_reproducible(client, model):
    def ask():
        out = client.chat.completions.create(
            model=model, messages=QUESTION, n=3, seed=7, temperature=1.0, max_tokens=16
        )
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = ask()
    assert len(first) == 3
    assert ask() == first


def test_seeded_request_same_alone_and_beside_eight_others(server_url, client, model):
    params = dict(model=model, messages=QUESTION, seed=11, temperature=0.8, max_tokens=20)
    alone = client.chat.completions.create(**params).choices[0].message.content

    async def crowd() -> str:
        async_client = openai.AsyncOpenAI(
            base_url=f"{server_url}/v1", api_key="unused", max_retries=0
        )
        others = [
            async_client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
                temperature=1.0,
                max_tokens=24,
            )
            for i in range(8)
        ]
        mine = async_client.chat.completions.create(**params)
        results = await asyncio.gather(*others, mine)
        await async_client.close()
        return results[-1].choices[0].message.content

    assert asyncio.run(crowd()) == alone


def test_stop_string_from_a_greedy_output_ends_before_it(client, model):
    full = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=24
    )
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop], stream=True
    )
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _no_request_holds_blocks(server_url) -> bool:
    metrics = scrape(server_url)
    return (
        metrics['kvshare_requests{state="running"}'] == 0
        and metrics['kvshare_requests{state="waiting"}'] == 0
        and metrics['kvshare_kv_blocks{state="private"}'] == 0
        and metrics['kvshare_kv_blocks{state="shared"}'] == 0
    )


async def _wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.2)
    return predicate()


def test_32_streams_complete_and_10_disconnects_leave_nothing_behind(server_url, model):
    async def full_stream(http: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Count to {i % 5 + 3}."}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        return lines[-1]

    async def abandoned_stream(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Write a long story number {i}."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave mid-stream: closing the response drops the connection

    async def main() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server_url, timeout=300, limits=limits) as http:
            done = await asyncio.gather(*(full_stream(http, i) for i in range(32)))
            assert done == ["data: [DONE]"] * 32
        async with httpx.AsyncClient(base_url=server_url, timeout=300, limits=limits) as http:
            await asyncio.gather(*(abandoned_stream(http, i) for i in range(10)))
        assert await _wait_until(lambda: _no_request_holds_blocks(server_url))

    asyncio.run(main())
    metrics = scrape(server_url)
    assert metrics["kvshare_kv_blocks_leaked"] == 0
    assert metrics['kvshare_requests_total{finish_reason="abort"}'] >= 10


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"max_tokens": 9000}, 400, "max_tokens"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 2}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"logit_bias": {"999999": 1}}, 400, "logit_bias"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            "tool_choice",
        ),
        ({"model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_input_gets_an_openai_error(server_url, model, body, status, param):
    request = {"model": model, "messages": QUESTION, **body}
    response = httpx.post(f"{server_url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"]


def test_prompt_over_the_context_window_reports_token_counts(server_url, model):
    long_text = "hello " * 9000
    body = {"model": model, "messages": [{"role": "user", "content": long_text}]}
    response = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "8192" in message  # the context window is named
    assert any(ch.isdigit() for ch in message.replace("8192", ""))  # and the prompt's count
