"""cache_diagnostics over HTTP with the fake engine: where the object appears (beside usage,
in the streamed usage chunk), the server-wide setting, and the 400 / 404 it can cause. The
reasons themselves come from the engine: tests/engine/kv/test_cache_diagnosis.py and
tests/integration/test_cache_diagnostics.py."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from helpers import chat_body, make_settings, open_client, sse_chunks

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


async def test_only_requests_that_ask_carry_it(client) -> None:
    plain = (await client.post(CHAT, json=chat_body())).json()
    assert "cache_diagnostics" not in plain
    asked = (await client.post(CHAT, json=chat_body(cache_diagnostics=True))).json()
    assert asked["usage"] == plain["usage"]
    # The fake engine reports no diagnosis: the prompt length and no reason.
    assert asked["cache_diagnostics"] == {
        "prompt_tokens": asked["usage"]["prompt_tokens"],
        "reason": None,
    }


async def test_the_setting_turns_it_on_for_every_request(engine: FakeEngine) -> None:
    async with open_client(engine, make_settings(cache_diagnostics=True)) as client:
        body = (await client.post(CHAT, json=chat_body())).json()
        assert body["cache_diagnostics"]["reason"] is None
        completion = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        body = (await client.post("/v1/completions", json=completion)).json()
        assert "cache_diagnostics" in body


async def test_streamed_it_rides_on_the_usage_chunk(client) -> None:
    body = chat_body(cache_diagnostics=True, stream=True, stream_options={"include_usage": True})
    chunks = sse_chunks((await client.post(CHAT, json=body)).text)
    assert [("cache_diagnostics" in chunk) for chunk in chunks] == [False] * (len(chunks) - 1) + [
        True
    ]
    assert chunks[-1]["usage"] is not None


@pytest.mark.parametrize(
    ("value", "status", "param"),
    [
        ("yes", 400, "cache_diagnostics"),
        ({"compare_to": 3}, 400, "cache_diagnostics"),
        ({"other": "x"}, 400, "cache_diagnostics"),
        ({"compare_to": "chatcmpl-unknown"}, 404, "cache_diagnostics.compare_to"),
    ],
)
async def test_bad_values_are_refused_naming_the_field(client, value, status, param) -> None:
    response = await client.post(CHAT, json=chat_body(cache_diagnostics=value))
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"].startswith(param)


async def test_compare_to_an_earlier_id(client, tokenizer_dir) -> None:
    from engine.tokenizer import Tokenizer

    first = (await client.post(CHAT, json=chat_body("hello there"))).json()
    second = chat_body("hello world", cache_diagnostics={"compare_to": first["id"]})
    comparison = (await client.post(CHAT, json=second)).json()["cache_diagnostics"]["compare_to"]
    tokenizer = Tokenizer(tokenizer_dir)
    ids_a = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}])
    ids_b = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}])
    index = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    assert comparison["id"] == first["id"]
    assert comparison["first_difference_index"] == index
    assert comparison["segment"] == {"kind": "message", "message_index": 0, "role": "user"}
    assert comparison["text_at"] == tokenizer.decode(ids_b[index : index + 8])


async def test_a_cache_salt_sees_only_its_own_recent_prompts(client) -> None:
    """Diagnostics and the cache report are scoped like the cache: tenant and cache_salt."""
    first = (await client.post(CHAT, json=chat_body("hello there", cache_salt="s1"))).json()
    asked = {"compare_to": first["id"]}
    other = chat_body("hello world", cache_salt="s2", cache_diagnostics=asked)
    refused = await client.post(CHAT, json=other)
    assert refused.status_code == 404, refused.text  # s2 never had it
    same = chat_body("hello world", cache_salt="s1", cache_diagnostics=asked)
    assert (await client.post(CHAT, json=same)).status_code == 200
    s1 = (await client.get("/debug/cache_report", params={"cache_salt": "s1"})).json()
    s2 = (await client.get("/debug/cache_report", params={"cache_salt": "s2"})).json()
    unsalted = (await client.get("/debug/cache_report")).json()
    assert (s1["num_prompts"], s2["num_prompts"], unsalted["num_prompts"]) == (2, 0, 0)


async def test_the_cache_report_renders_its_segments_off_the_event_loop(client, monkeypatch):
    import threading

    from app.diagnostics.cache import RecentPrompt

    threads = []
    segments = RecentPrompt.segments

    def recording(self, tokenizer):
        threads.append(threading.current_thread())
        return segments(self, tokenizer)

    monkeypatch.setattr(RecentPrompt, "segments", recording)
    await client.post(CHAT, json=chat_body("hello there"))
    assert (await client.get("/debug/cache_report")).status_code == 200
    assert threads and threading.main_thread() not in threads
