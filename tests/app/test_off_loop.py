"""Responses are built and encoded off the event loop (issue 55).

A non-streaming response with logprobs (an entry per token and top token, each named by the
tokenizer) takes a second or more near max_logprob_entries, and a streamed echo's first chunk
grows with its prompt: both run in a worker thread, so the loop keeps answering other
requests, and the bytes a client receives are what they were when the loop built them.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fake_engine import FakeEngine, fake_logprob
from helpers import MODEL, chat_body, sse_chunks
from starlette.responses import JSONResponse

from app import streaming
from app.openai import formatting
from app.openai.chat_format import ChatFormatter
from app.openai.completion_format import CompletionFormatter
from app.serving import service

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT_IDS = list(range(5, 37))  # 32 tokens


class ScoringEngine(FakeEngine):
    """A FakeEngine that scores the prompt for echo with logprobs, as the engine does: tokens
    1.. of the prompt, once, with a request's first output."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        super().__init__(tokenizer_path)
        self.scored: set[str] = set()

    def _output(self, request, outputs, finished, error=None):
        output = super()._output(request, outputs, finished, error)
        num_top = request.sampling_params.prompt_logprobs
        if num_top is not None and request.request_id not in self.scored:
            self.scored.add(request.request_id)
            vocab_size = self.model_info.vocab_size
            output.prompt_logprobs = [
                fake_logprob(token_id, position, num_top, vocab_size)
                for position, token_id in enumerate(request.prompt_token_ids[1:])
            ]
        return output


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    return ScoringEngine(tokenizer_dir)


class Threads:
    """The threads each watched piece of work ran in."""

    def __init__(self) -> None:
        self.loop = threading.get_ident()  # built on the test's event loop
        self.seen: dict[str, set[int]] = defaultdict(set)

    def watch(self, name: str, function: Callable, when: Callable[..., bool] | None = None):
        def watched(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(*args, **kwargs):
                self.seen[name].add(threading.get_ident())
            return function(*args, **kwargs)

        return watched

    def assert_off_the_loop(self, *names: str) -> None:
        for name in names:
            assert self.seen[name], f"{name}: never ran"
            assert self.loop not in self.seen[name], f"{name} ran on the event loop"


def watch_building(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, is_large: Callable[[dict], bool]
) -> Threads:
    """Watch where the formatters build, where token names are looked up, and where a
    response or chunk that is_large() is encoded: by json_body and sse_event, or by the
    JSONResponse that encoded responses on the event loop before (issue 55)."""
    threads = Threads()
    for formatter in (ChatFormatter, CompletionFormatter):
        monkeypatch.setattr(formatter, "response", threads.watch("build", formatter.response))
    prompt_part = CompletionFormatter._prompt_logprobs
    monkeypatch.setattr(
        CompletionFormatter, "_prompt_logprobs", threads.watch("echo logprobs", prompt_part)
    )
    tokenizer = client.app.state.kvshare.serving.model.tokenizer  # type: ignore[attr-defined]
    monkeypatch.setattr(tokenizer, "token_bytes", threads.watch("names", tokenizer.token_bytes))

    def is_large_body(data: Any, *args: Any, **kwargs: Any) -> bool:
        return isinstance(data, dict) and "choices" in data and is_large(data)

    render = threads.watch("encode", JSONResponse.render, lambda _, data: is_large_body(data))
    monkeypatch.setattr(JSONResponse, "render", render)
    # The encoders now, and those of the streamed chunks before (absent names are skipped).
    for module, name in (
        (formatting, "json_body"),
        (service, "sse_event"),
        (streaming, "sse_event"),
    ):
        if hasattr(module, name):
            watched = threads.watch("encode", getattr(module, name), is_large_body)
            monkeypatch.setattr(module, name, watched)
    return threads


def num_logprob_tokens(data: dict) -> int:
    """How many tokens a response's or chunk's logprobs name (either endpoint's shape)."""
    total = 0
    for choice in data["choices"]:
        logprobs = choice.get("logprobs") or {}
        total += len(logprobs.get("tokens") or logprobs.get("content") or [])
    return total


async def test_an_echo_with_logprobs_is_built_and_encoded_off_the_loop(client, monkeypatch) -> None:
    threads = watch_building(client, monkeypatch, lambda data: num_logprob_tokens(data) > 0)
    body = {
        "model": MODEL,
        "prompt": [PROMPT_IDS] * 4,
        "echo": True,
        "logprobs": 20,
        "n": 2,
        "max_tokens": 4,
    }
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 8
    logprobs = choices[7]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT_IDS) + 4
    assert logprobs["token_logprobs"][:3] == [None, -0.25, -0.5]  # the prompt, as scored
    assert len(logprobs["top_logprobs"][1]) == 20
    threads.assert_off_the_loop("build", "echo logprobs", "names", "encode")


async def test_chat_logprobs_are_built_and_encoded_off_the_loop(client, monkeypatch) -> None:
    threads = watch_building(client, monkeypatch, lambda data: num_logprob_tokens(data) > 0)
    body = chat_body(logprobs=True, top_logprobs=20, n=2, max_tokens=8)
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200
    content = response.json()["choices"][1]["logprobs"]["content"]
    assert [len(entry["top_logprobs"]) for entry in content] == [20] * len(content)
    threads.assert_off_the_loop("build", "names", "encode")


async def test_a_streamed_echo_chunk_is_built_and_encoded_off_the_loop(client, monkeypatch) -> None:
    """The echo chunk scores the whole prompt; the chunks after it carry a token or so each
    and are built on the loop, where a worker thread would cost more than they do."""
    threads = watch_building(
        client, monkeypatch, lambda data: num_logprob_tokens(data) >= len(PROMPT_IDS)
    )
    body = {
        "model": MODEL,
        "prompt": [PROMPT_IDS] * 2,
        "echo": True,
        "logprobs": 20,
        "max_tokens": 4,
        "stream": True,
    }
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200
    chunks = sse_chunks(response.text)
    echoes = [c for c in chunks if num_logprob_tokens(c) == len(PROMPT_IDS)]
    assert sorted(c["choices"][0]["index"] for c in echoes) == [0, 1]
    threads.assert_off_the_loop("echo logprobs", "encode")


async def test_health_answers_while_a_response_is_being_built(client, monkeypatch) -> None:
    """Held in the middle of building a response, the worker thread leaves the loop free to
    answer /health. (Built on the loop, the hold would stall /health until it timed out.)"""
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    response = CompletionFormatter.response

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        is_released = release.wait(5)
        left.set()
        assert is_released, "nobody released the build"
        return response(*args, **kwargs)

    monkeypatch.setattr(CompletionFormatter, "response", held)
    body = {"model": MODEL, "prompt": PROMPT_IDS, "echo": True, "logprobs": 20, "max_tokens": 4}
    result: list[httpx.Response] = []
    async with anyio.create_task_group() as tasks:

        async def run_big() -> None:
            result.append(await client.post(COMPLETIONS, json=body, timeout=60))

        tasks.start_soon(run_big)
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(entered.wait)
        with anyio.fail_after(2):
            health = await client.get("/health")
        assert health.status_code == 200
        assert not left.is_set(), "/health waited for the build"
        release.set()
    assert result[0].status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            COMPLETIONS,
            {"prompt": "Héllo wörld ✓", "echo": True, "logprobs": 2, "cache_diagnostics": True},
        ),
        (CHAT, chat_body("Héllo ✓", logprobs=True, top_logprobs=2, cache_diagnostics=True)),
        (CHAT, chat_body("plain")),
    ],
)
async def test_the_body_is_what_jsonresponse_renders(client, path: str, body: dict) -> None:
    """Byte for byte: compact separators, text as UTF-8 (not \\u escapes), floats as Python
    writes them, cache_diagnostics after usage."""
    response = await client.post(path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    data = response.json()
    assert response.content == JSONResponse(data).body
    if "cache_diagnostics" in body:
        assert list(data)[-2:] == ["usage", "cache_diagnostics"]


@pytest.mark.parametrize("num_tokens", [0, 1, 256, 257, 1000])
def test_json_body_encoded_in_parts_is_what_jsonresponse_renders(num_tokens: int) -> None:
    """Around the slice length (256 items a call) and past the levels split part by part."""
    top = [{"é": -0.5, "✓": -1.5}] * num_tokens
    completion = {"tokens": ["é"] * num_tokens, "token_logprobs": [None, -1e-05][:num_tokens]}
    chat = {"content": [{"token": "✓", "logprob": -0.1, "bytes": [226], "top_logprobs": top}]}
    data = {
        "id": "x",
        "choices": [
            {"index": 0, "text": "héllo", "logprobs": {**completion, "top_logprobs": top}},
            {"index": 1, "message": {"content": None}, "logprobs": chat, "flag": True},
        ]
        * 2,
        "usage": {"nested": {"deeper": [[1, 2], {"a": [3]}]}},
        "cache_diagnostics": {"reason": None, "empty": []},
    }
    assert formatting.json_body(data) == JSONResponse(data).body
