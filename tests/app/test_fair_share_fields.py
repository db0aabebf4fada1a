"""What fair share needs from the HTTP edge: the tenant (API key, or `user` when opted in) and
the `priority` extension field on every EngineRequest; priority outside its bounds is a 400."""

from __future__ import annotations

import pytest
from helpers import chat_body, make_settings, open_client

from engine.core.protocol import MAX_PRIORITY, MIN_PRIORITY

pytestmark = pytest.mark.anyio

KEYS = ("key-alpha", "key-beta")


async def test_each_key_is_its_own_tenant_and_priority_passes_through(engine) -> None:
    async with open_client(engine, make_settings(api_keys=KEYS)) as client:
        for key, priority in [("key-alpha", -3), ("key-beta", None), ("key-alpha", 7)]:
            extra = {} if priority is None else {"priority": priority}
            headers = {"Authorization": f"Bearer {key}"}
            body = chat_body(max_tokens=2, user="same-user", **extra)
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    tenants = [request.tenant for request in engine.requests]
    assert tenants[0] is not None and tenants[0] == tenants[2] != tenants[1]
    assert all("key-" not in tenant for tenant in tenants)  # the key itself never travels
    assert [request.priority for request in engine.requests] == [-3, 0, 7]


@pytest.mark.parametrize("from_user", [False, True])
async def test_without_keys_one_tenant_unless_user_is_opted_in(engine, from_user) -> None:
    async with open_client(engine, make_settings(tenant_from_user=from_user)) as client:
        for user in ("ann", "bob", "ann", None):
            body = chat_body(max_tokens=2, **({"user": user} if user else {}))
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
    tenants = [request.tenant for request in engine.requests]
    if not from_user:
        assert tenants == [None, None, None, None]
        return
    assert tenants[0] == tenants[2] != tenants[1] and tenants[3] is None
    assert "ann" not in tenants[0]
    assert [request.cache_salt for request in engine.requests] == [None] * 4  # cache unchanged


@pytest.mark.parametrize("priority", [MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5, "high"])
async def test_priority_out_of_range_is_a_400_naming_the_field(engine, priority) -> None:
    async with open_client(engine) as client:
        body = chat_body(max_tokens=2, priority=priority)
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "priority"
        ok = await client.post("/v1/completions", json={"prompt": "hi", "priority": MIN_PRIORITY})
        assert ok.status_code == 200, ok.text
    assert [request.priority for request in engine.requests] == [MIN_PRIORITY]
