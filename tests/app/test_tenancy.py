"""One prefix-cache tenant per API key: the cache salt the engine sees comes from the key."""

from __future__ import annotations

import pytest
from helpers import chat_body, make_settings, open_client

pytestmark = pytest.mark.anyio

KEYS = ("key-alpha", "key-beta")


async def salts_for(engine, calls: list[tuple[str, str | None]]) -> list[str | None]:
    async with open_client(engine, make_settings(api_keys=KEYS)) as client:
        for key, cache_salt in calls:
            body = chat_body(max_tokens=2, **({"cache_salt": cache_salt} if cache_salt else {}))
            headers = {"Authorization": f"Bearer {key}"}
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    return [request.cache_salt for request in engine.requests]


async def test_each_key_is_its_own_namespace(engine) -> None:
    salts = await salts_for(engine, [("key-alpha", None), ("key-beta", None), ("key-alpha", None)])
    assert salts[0] is not None and salts[1] is not None
    assert salts[0] != salts[1]  # two keys never share
    assert salts[0] == salts[2]  # the same key does


async def test_cache_salt_narrows_within_a_key(engine) -> None:
    salts = await salts_for(
        engine, [("key-alpha", "team-1"), ("key-alpha", "team-2"), ("key-beta", "team-1")]
    )
    assert len(set(salts)) == 3
    assert all("key-alpha" not in salt for salt in salts)  # the key itself never travels


async def test_without_keys_cache_salt_passes_through(engine) -> None:
    async with open_client(engine) as client:
        await client.post("/v1/chat/completions", json=chat_body(max_tokens=2, cache_salt="s"))
        await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert [r.cache_salt for r in engine.requests] == ["s", None]
