"""Stored responses over HTTP (FakeEngine, a real SQLite file per test): retrieve, delete,
input_items pages, previous_response_id chains and their prompts, tenant scoping."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from helpers import MODEL, make_settings, open_client
from openai_schemas import assert_valid
from tiny_tokenizer import FAKE_TEXTS

from engine.core.protocol import FinishReason

pytestmark = pytest.mark.anyio

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
TOOLS = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]


@pytest.fixture
def engine(tokenizer_dir) -> FakeEngine:
    """Room for chains and tool sections (the tiny tokenizer spells JSON in bytes)."""
    return FakeEngine(tokenizer_dir, max_model_len=4096)


def script(engine: FakeEngine, text: str) -> None:
    """Every request generates `text`, then EOS."""
    ids = engine.tokenizer.encode(text, False)
    engine.script = lambda params, index: (  # type: ignore[method-assign]
        [*ids, engine.eos_token_id],
        FinishReason.STOP,
        engine.eos_token_id,
    )


async def create(client, **fields) -> dict:
    response = await client.post("/v1/responses", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    data = response.json()
    assert_valid("Response", data)
    return data


def assert_error(response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert_valid("ErrorResponse", response.json())
    assert response.json()["error"]["param"] == param


async def test_stored_by_default_and_read_back_as_returned(client) -> None:
    created = await create(client, input="hi", metadata={"k": "v"})
    assert created["store"] is True
    fetched = await client.get(f"/v1/responses/{created['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == created
    items = (await client.get(f"/v1/responses/{created['id']}/input_items")).json()
    assert_valid("ResponseItemList", items)
    assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == [
        ("message", "user", [{"type": "input_text", "text": "hi"}])
    ]


async def test_store_false_keeps_nothing(client) -> None:
    created = await create(client, input="hi", store=False)
    assert created["store"] is False
    assert_error(await client.get(f"/v1/responses/{created['id']}"), 404, None)
    body = {"model": MODEL, "input": "more", "previous_response_id": created["id"]}
    assert_error(await client.post("/v1/responses", json=body), 404, "previous_response_id")


async def test_delete_answers_the_deleted_object_then_404s(client) -> None:
    created = await create(client, input="hi")
    deleted = await client.delete(f"/v1/responses/{created['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
    for path in ("", "/input_items"):
        assert_error(await client.get(f"/v1/responses/{created['id']}{path}"), 404, None)
    assert_error(await client.delete(f"/v1/responses/{created['id']}"), 404, None)
    assert_error(await client.get("/v1/responses/resp_unknown"), 404, None)


async def test_a_chain_carries_inputs_and_outputs_but_not_instructions(client, engine) -> None:
    first = await create(client, input="one", instructions="be brief")
    second = await create(client, input="two", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert second["instructions"] is None
    messages = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": FAKE_TEXTS[0]},
        {"role": "user", "content": "two"},
    ]
    prompt = engine.requests[1].prompt_token_ids
    text = engine.tokenizer.render_chat(messages)
    assert engine.tokenizer.decode(prompt, skip_special_tokens=False) == text
    items = (await client.get(f"/v1/responses/{second['id']}/input_items?order=asc")).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["one", FAKE_TEXTS[0], "two"]
    assert items["data"][1]["id"] == first["output"][0]["id"]


async def test_a_continuation_starts_with_the_previous_prompt_and_output_tokens(
    client, engine
) -> None:
    """The output is kept as generated, not re-tokenized: the model spells "Hello world" in
    single characters (the tokenizer would merge them), and the next prompt starts with those
    very tokens and the EOS (<|im_end|>, as the template writes it), so its blocks match."""
    spelled = [engine.tokenizer.encode(c, False)[0] for c in "Hello world"]
    assert engine.tokenizer.encode("Hello world", False) != spelled
    generated = [*spelled, engine.eos_token_id]
    engine.script = lambda params, index: (generated, FinishReason.STOP, engine.eos_token_id)
    first = await create(client, input="one")
    second = await create(client, input="two", previous_response_id=first["id"])
    await create(client, input="three", previous_response_id=second["id"])
    for turn in (1, 2):
        previous, prompt = engine.requests[turn - 1], engine.requests[turn].prompt_token_ids
        expected = previous.prompt_token_ids + generated
        assert prompt[: len(expected)] == expected
        rest = engine.tokenizer.decode(prompt[len(expected) :], skip_special_tokens=False)
        assert rest == "\n<|im_start|>user\n" + ("two" if turn == 1 else "three") + (
            "<|im_end|>\n<|im_start|>assistant\n"
        )


async def test_function_calls_and_outputs_carry_over_the_chain(client, engine) -> None:
    script(engine, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    first = await create(client, input="time?", tools=TOOLS)
    (call,) = first["output"]
    assert call["type"] == "function_call"
    script(engine, "It is noon.")
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "12:00"}
    second = await create(client, input=[output], tools=TOOLS, previous_response_id=first["id"])
    assert second["output"][0]["content"][0]["text"] == "It is noon."
    text = engine.tokenizer.decode(engine.requests[1].prompt_token_ids, False)
    assert text.index("time?") < text.index('"get_time"', text.index("time?"))
    assert text.rindex("12:00") > text.index("<tool_call>")
    items = (await client.get(f"/v1/responses/{second['id']}/input_items")).json()
    assert_valid("ResponseItemList", items)
    assert [i["type"] for i in items["data"]] == [
        "function_call_output",
        "function_call",
        "message",
    ]


BAD_CHAIN_INPUT = [
    ([{"type": "function_call_output", "call_id": "nope", "output": "1"}], "input[0].call_id"),
    (
        ["ok", {"type": "function_call_output", "call_id": "nope", "output": "1"}],
        "input[1].call_id",
    ),
    ([{"type": "image"}], "input[0].type"),
]


@pytest.mark.parametrize(("given", "param"), BAD_CHAIN_INPUT)
async def test_bad_input_after_a_chain_names_the_input_field(client, given, param) -> None:
    first = await create(client, input=[{"role": "user", "content": "hi"}, CALL], tools=TOOLS)
    items = [{"role": "user", "content": item} if isinstance(item, str) else item for item in given]
    body = {"model": MODEL, "input": items, "previous_response_id": first["id"], "tools": TOOLS}
    assert_error(await client.post("/v1/responses", json=body), 400, param)
    # The chain's own call is answerable.
    answer = [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]
    await create(client, input=answer, previous_response_id=first["id"], tools=TOOLS)


async def test_input_items_pages_per_the_spec(client) -> None:
    given = [{"role": "user", "content": f"m{n}"} for n in range(5)]
    created = await create(client, input=given)
    path = f"/v1/responses/{created['id']}/input_items"
    everything = (await client.get(path, params={"order": "asc"})).json()
    ids = [item["id"] for item in everything["data"]]
    assert [i["content"][0]["text"] for i in everything["data"]] == [f"m{n}" for n in range(5)]
    assert everything["has_more"] is False
    page = (await client.get(path, params={"limit": 2})).json()  # desc by default
    assert_valid("ResponseItemList", page)
    assert [i["id"] for i in page["data"]] == ids[::-1][:2]
    assert (page["first_id"], page["last_id"], page["has_more"]) == (ids[4], ids[3], True)
    after = (await client.get(path, params={"limit": 2, "after": page["last_id"]})).json()
    assert [i["id"] for i in after["data"]] == [ids[2], ids[1]] and after["has_more"] is True
    before = (await client.get(path, params={"order": "asc", "before": ids[2]})).json()
    assert [i["id"] for i in before["data"]] == ids[:2] and before["has_more"] is False
    last = (await client.get(path, params={"order": "asc", "after": ids[4]})).json()
    assert last["data"] == [] and last["has_more"] is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_unknown"}, "after"),
        ({"include": "file_search_call.results"}, "include"),
    ],
)
async def test_bad_input_items_queries_are_400s(client, query: dict, param: str) -> None:
    created = await create(client, input="hi")
    response = await client.get(f"/v1/responses/{created['id']}/input_items", params=query)
    assert_error(response, 400, param)


async def test_responses_are_scoped_to_the_api_key_and_the_cache_salt(engine) -> None:
    settings = make_settings(api_keys=("key-a", "key-b"))
    async with open_client(engine, settings) as client:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        body = {"model": MODEL, "input": "hi"}
        plain = (await client.post("/v1/responses", json=body, headers=a)).json()
        salted_body = {**body, "cache_salt": "s1"}
        salted = (await client.post("/v1/responses", json=salted_body, headers=a)).json()
        for path in ("", "/input_items"):
            assert (await client.get(f"/v1/responses/{plain['id']}{path}", headers=a)).is_success
            assert_error(
                await client.get(f"/v1/responses/{plain['id']}{path}", headers=b), 404, None
            )
            url = f"/v1/responses/{salted['id']}{path}"
            assert (await client.get(url, headers=a, params={"cache_salt": "s1"})).is_success
            assert_error(await client.get(url, headers=a), 404, None)
            assert_error(await client.get(url, headers=a, params={"cache_salt": "s2"}), 404, None)
        follow = {**body, "previous_response_id": plain["id"]}
        refused = await client.post("/v1/responses", json=follow, headers=b)
        assert_error(refused, 404, "previous_response_id")
        other_salt = {**follow, "cache_salt": "s1"}
        refused = await client.post("/v1/responses", json=other_salt, headers=a)
        assert_error(refused, 404, "previous_response_id")
        assert_error(await client.delete(f"/v1/responses/{plain['id']}", headers=b), 404, None)
        assert (await client.post("/v1/responses", json=follow, headers=a)).is_success
        assert (await client.delete(f"/v1/responses/{plain['id']}", headers=a)).is_success


async def test_one_tenant_s_flood_evicts_its_own_responses_not_another_s(engine) -> None:
    """Bound 5, two tenants: a's share is 2.5, so a's fifth and sixth evict a's oldest two."""
    settings = make_settings(api_keys=("key-a", "key-b"), store_max_responses=5)
    async with open_client(engine, settings) as client:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        body = {"model": MODEL, "input": "hi"}
        kept = (await client.post("/v1/responses", json=body, headers=b)).json()
        flood = [
            (await client.post("/v1/responses", json=body, headers=a)).json() for _ in range(6)
        ]
        fetched = await client.get(f"/v1/responses/{kept['id']}", headers=b)
        assert fetched.status_code == 200 and fetched.json() == kept
        statuses = [
            (await client.get(f"/v1/responses/{created['id']}", headers=a)).status_code
            for created in flood
        ]
        assert statuses == [404, 404, 200, 200, 200, 200]
        text = (await client.get("/metrics", headers=a)).text
    assert 'kvshare_response_store_evictions_total{reason="count"} 2.0' in text
    assert "kvshare_stored_responses 5.0" in text


async def test_a_response_over_the_byte_bound_says_store_false(engine) -> None:
    async with open_client(engine, make_settings(store_max_bytes=1024)) as client:
        created = await create(client, input="x" * 1500)
        assert created["store"] is False
        assert_error(await client.get(f"/v1/responses/{created['id']}"), 404, None)


async def test_store_metrics_follow_the_store(engine) -> None:
    async with open_client(engine, make_settings(store_max_responses=2)) as client:
        for number in range(3):
            await create(client, input=f"q{number}")
        text = (await client.get("/metrics")).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvshare_"))
    assert float(samples["kvshare_stored_responses"]) == 2
    assert float(samples["kvshare_response_store_bytes"]) > 0
    assert float(samples['kvshare_response_store_evictions_total{reason="count"}']) == 1
    assert float(samples['kvshare_response_store_evictions_total{reason="ttl"}']) == 0
    assert float(samples['kvshare_response_store_evictions_total{reason="bytes"}']) == 0


async def test_responses_survive_a_new_app_on_the_same_file(engine, tokenizer_dir) -> None:
    async with open_client(engine) as client:
        created = await create(client, input="hi")
    async with open_client(FakeEngine(tokenizer_dir)) as client:
        fetched = await client.get(f"/v1/responses/{created['id']}")
        assert fetched.status_code == 200 and fetched.json() == created
        second = await create(client, input="more", previous_response_id=created["id"])
    assert json.dumps(second["previous_response_id"]) == json.dumps(created["id"])


async def test_an_expired_response_reads_as_unknown(engine) -> None:
    """The store's clock, moved past store_ttl_seconds (no waiting)."""
    async with open_client(engine, make_settings(store_ttl_seconds=60.0)) as client:
        store = client.app.state.kvshare.responses.store
        now = [store.clock()]
        store.clock = lambda: now[0]
        created = await create(client, input="hi")
        now[0] += 59.0
        assert (await client.get(f"/v1/responses/{created['id']}")).status_code == 200
        now[0] += 1.0
        assert_error(await client.get(f"/v1/responses/{created['id']}"), 404, None)
        body = {"model": MODEL, "input": "more", "previous_response_id": created["id"]}
        assert_error(await client.post("/v1/responses", json=body), 404, "previous_response_id")
        text = (await client.get("/metrics")).text
    assert 'kvshare_response_store_evictions_total{reason="ttl"} 1.0' in text
    assert "kvshare_stored_responses 0.0" in text
