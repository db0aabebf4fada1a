"""Limits on what one request can make the server do.

Every cap (a server setting, app/serving/limits.py) is met exactly by one request (served)
and passed by one (a 400 naming the field) while a normal request is in the middle of
generating, which then completes. OpenAI's fixed ranges (temperature 0..2, ...) are refused the
same way. And a request's preparation (chat template, tokenizer) runs off the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest
from fake_engine import FakeEngine
from helpers import chat_body, open_client
from openai_schemas import assert_valid

from app.openai.json_schema import canonical_json
from app.settings import ServerSettings, Settings
from engine.core.config import MAX_SCHEMA_BYTES_CEILING, EngineConfig
from engine.core.errors import ParamError

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CAPS = {
    "max_n": 2,
    "max_output_tokens": 8,
    "max_prompts": 2,
    "max_messages": 3,
    "max_stop_strings": 2,
    "max_stop_string_chars": 4,
    "max_logit_bias_entries": 2,
    "max_top_logprobs": 3,
    "max_tools": 2,
    "max_stop_token_ids": 3,
    "max_logprob_entries": 40,
}
MAX_SCHEMA_BYTES = 200


def schema_of(num_bytes: int) -> dict:
    """A schema whose canonical JSON (what max_schema_bytes measures) is `num_bytes` long."""
    base = len(canonical_json({"description": "", "type": "object"}))
    return {"type": "object", "description": "x" * (num_bytes - base)}


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, **({"parameters": parameters} if parameters else {})}
    return {"type": "function", "function": function}


def chat(**fields: object) -> tuple[str, dict]:
    return CHAT, chat_body(**{"max_tokens": 4, **fields})


def completion(**fields: object) -> tuple[str, dict]:
    return COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, **fields}


def messages(count: int) -> list[dict]:
    return [{"role": "user", "content": f"turn {i}"} for i in range(count)]


def json_schema_format(num_bytes: int) -> dict:
    spec = {"name": "answer", "schema": schema_of(num_bytes)}
    return {"type": "json_schema", "json_schema": spec}


# cap, the field a refusal names, request(value) -> (route, body)
CASES: list[tuple[int, str, Callable[[int], tuple[str, dict]]]] = [
    (CAPS["max_n"], "n", lambda k: chat(n=k)),
    (CAPS["max_n"], "n", lambda k: completion(n=k)),
    (CAPS["max_output_tokens"], "max_tokens", lambda k: chat(max_tokens=k)),
    (CAPS["max_output_tokens"], "max_completion_tokens", lambda k: chat(max_completion_tokens=k)),
    (CAPS["max_output_tokens"], "max_tokens", lambda k: completion(max_tokens=k)),
    (CAPS["max_prompts"], "prompt", lambda k: completion(prompt=["Hello"] * k)),
    (CAPS["max_prompts"], "prompt", lambda k: completion(prompt=[[5, 6]] * k)),
    (CAPS["max_messages"], "messages", lambda k: chat(messages=messages(k))),
    (CAPS["max_stop_strings"], "stop", lambda k: chat(stop=[f"s{i}" for i in range(k)])),
    (CAPS["max_stop_strings"], "stop", lambda k: completion(stop=[f"s{i}" for i in range(k)])),
    (CAPS["max_stop_string_chars"], "stop", lambda k: chat(stop="z" * k)),
    (CAPS["max_stop_string_chars"], "stop", lambda k: completion(stop=["a", "z" * k])),
    (
        CAPS["max_logit_bias_entries"],
        "logit_bias",
        lambda k: chat(logit_bias=dict.fromkeys(map(str, range(k)), 1)),
    ),
    (CAPS["max_top_logprobs"], "top_logprobs", lambda k: chat(logprobs=True, top_logprobs=k)),
    (CAPS["max_stop_token_ids"], "stop_token_ids", lambda k: chat(stop_token_ids=[7] * k)),
    (CAPS["max_stop_token_ids"], "stop_token_ids", lambda k: completion(stop_token_ids=[7] * k)),
    (  # echoed prompt tokens, one logprob each: the response's entries
        CAPS["max_logprob_entries"],
        "logprobs",
        lambda k: completion(prompt=[5] * k, echo=True, logprobs=0, max_tokens=0),
    ),
    (CAPS["max_top_logprobs"], "logprobs", lambda k: completion(logprobs=k)),
    (
        CAPS["max_tools"],
        "tools",
        lambda k: chat(tools=[tool(f"f{i}") for i in range(k)], tool_choice="none"),
    ),
    (MAX_SCHEMA_BYTES, "response_format", lambda k: chat(response_format=json_schema_format(k))),
    (
        MAX_SCHEMA_BYTES,
        "response_format",
        lambda k: completion(response_format=json_schema_format(k)),
    ),
    (
        MAX_SCHEMA_BYTES,
        "tools[0].function.parameters",
        lambda k: chat(tools=[tool("f", schema_of(k))], tool_choice="none"),
    ),
    (  # the tools' schemas together: the engine compiles them into one grammar
        MAX_SCHEMA_BYTES,
        "tools",
        lambda k: chat(
            tools=[tool("f", schema_of(k // 2)), tool("g", schema_of(k - k // 2))],
            tool_choice="none",
        ),
    ),
]
IDS = [
    f"{param}-{make(1)[0].rsplit('/', 1)[-1]}-{number}"
    for number, (_, param, make) in enumerate(CASES)
]


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(tokenizer_dir, max_model_len=4096)


@pytest.fixture
async def client(engine: FakeEngine):
    settings = Settings(
        server=ServerSettings(**CAPS), engine=EngineConfig(max_schema_bytes=MAX_SCHEMA_BYTES)
    )
    async with open_client(engine, settings) as client:
        yield client


def assert_refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert_valid("ErrorResponse", body)
    assert body["error"]["param"] == param
    return body["error"]["message"]


@pytest.mark.parametrize(("cap", "param", "make"), CASES, ids=IDS)
async def test_a_request_at_the_cap_is_served(client, cap: int, param: str, make) -> None:
    route, body = make(cap)
    response = await client.post(route, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("cap", "param", "make"), CASES, ids=IDS)
async def test_one_over_the_cap_is_a_400_while_a_normal_request_completes(
    client, engine: FakeEngine, cap: int, param: str, make
) -> None:
    engine.pause_after_tokens = 2  # the normal request holds here until resumed
    route, body = make(cap + 1)
    async with anyio.create_task_group() as tasks:
        normal: list[httpx.Response] = []

        async def run_normal() -> None:
            normal.append(await client.post(CHAT, json=chat_body(max_tokens=6)))

        tasks.start_soon(run_normal)
        with anyio.fail_after(5):
            await engine.paused.wait()
        message = assert_refused(await client.post(route, json=body), param)
        assert not normal  # refused while the other one was mid-generation
        engine.resume.set()
    assert normal[0].status_code == 200, normal[0].text
    assert normal[0].json()["choices"][0]["message"]["content"]
    assert str(cap) in message  # the refusal states the limit
    assert len(engine.requests) == 1  # nothing of the refused request reached the engine


def test_the_caps_are_the_settings_keys() -> None:
    """Each cap here is a ServerSettings key, and each such key is exercised above."""
    limit_keys = {key for key in ServerSettings.model_fields if key in CAPS}
    assert limit_keys == set(CAPS)
    assert {"max_n", "max_stop_strings"} <= limit_keys  # were constants of the request models


# -- OpenAI's fixed ranges --------------------------------------------------------------------

OUT_OF_RANGE = [
    ("temperature", 5),
    ("temperature", 2.01),
    ("temperature", -0.1),
    ("top_p", 1.5),
    ("top_p", 0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("n", 0),
    ("max_tokens", 0),
    ("max_completion_tokens", 0),
    ("seed", -1),
    ("seed", 2**63),
    ("min_p", 1.5),
    ("top_k", -2),
    ("repetition_penalty", 0),
    ("min_tokens", -1),
]
IN_RANGE = [
    ("temperature", 0),
    ("temperature", 2),
    ("top_p", 1),
    ("presence_penalty", -2),
    ("presence_penalty", 2),
    ("frequency_penalty", -2),
    ("frequency_penalty", 2),
    ("seed", 2**63 - 1),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
async def test_a_value_outside_the_openai_range_is_a_400_naming_it(client, field, value) -> None:
    message = assert_refused(await client.post(CHAT, json=chat_body(**{field: value})), field)
    assert field in message


@pytest.mark.parametrize(("field", "value"), IN_RANGE)
async def test_the_ends_of_the_openai_ranges_are_served(client, field, value) -> None:
    response = await client.post(CHAT, json=chat_body(max_tokens=4, **{field: value}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        (chat_body(logit_bias={"5": 100.5}), "logit_bias"),
        (chat_body(logit_bias={"-1": 1}), "logit_bias"),
        (chat_body(stop_token_ids=[-1]), "stop_token_ids[0]"),
    ],
)
async def test_ranges_of_nested_values(tokenizer_dir: Path, body: dict, param: str) -> None:
    """With the default settings too (top_logprobs' cap is at most OpenAI's 20)."""
    route = COMPLETIONS if "prompt" in body else CHAT
    async with open_client(FakeEngine(tokenizer_dir)) as client:
        assert_refused(await client.post(route, json=body), param)


def test_top_logprobs_cap_cannot_exceed_what_the_engine_returns() -> None:
    with pytest.raises(ValueError, match="max_top_logprobs"):
        ServerSettings(max_top_logprobs=21)


# -- preparation off the event loop -------------------------------------------------------------


async def test_health_answers_while_a_prompt_is_being_prepared(client, engine) -> None:
    """The chat template and the tokenizer run in a worker thread: held there, the loop still
    answers /health. (Run on the loop, the hold would stall /health until it timed out.)"""
    tokenizer = client.app.state.kvshare.serving.model.tokenizer
    entered, release = threading.Event(), threading.Event()
    apply_chat_template = tokenizer.apply_chat_template

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(10), "nobody released the preparation"
        return apply_chat_template(*args, **kwargs)

    tokenizer.apply_chat_template = held
    big = "word " * (512 * 1024)  # 2.5 MiB of content, under max_body_bytes
    result: list[httpx.Response] = []
    async with anyio.create_task_group() as tasks:

        async def run_big() -> None:
            body = chat_body(big)
            result.append(await client.post(CHAT, json=body, timeout=60))

        tasks.start_soon(run_big)
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(entered.wait)
        with anyio.fail_after(2):
            health = await client.get("/health")
        assert health.status_code == 200
        assert not result  # still being prepared
        release.set()
    # The tiny engine's context is 4096 tokens: the prompt is refused, after tokenizing.
    assert_refused(result[0], "messages")
    assert "context" in result[0].json()["error"]["message"]


# -- what the fuzzing found (tests/integration/test_fuzz.py) ------------------------------------

WRONG_TYPES = [
    ("presence_penalty", False),  # was taken as 0.0
    ("temperature", "1"),  # was taken as 1.0
    ("n", "2"),
    ("seed", True),
    ("stream", "yes"),  # was taken as true
    ("logprobs", 1),
]


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
async def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(client, field, value):
    assert_refused(await client.post(CHAT, json=chat_body(**{field: value})), field)


@pytest.mark.parametrize(
    "content",
    [b'{"prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000],
    ids=["not-utf-8", "nested-past-the-stack"],
)
async def test_a_body_the_parser_cannot_read_is_a_400_invalid_json(client, content) -> None:
    headers = {"content-type": "application/json"}
    response = await client.post(COMPLETIONS, content=content, headers=headers)
    assert response.status_code == 400, response.text
    body = response.json()
    assert_valid("ErrorResponse", body)
    assert body["error"]["code"] == "invalid_json"


async def test_max_schema_bytes_above_the_old_64_kib_takes_effect(engine: FakeEngine) -> None:
    """A raised cap is the cap: 100 KB of schema is served under 128 KiB, refused one past it."""
    raised = 128 * 1024
    settings = Settings(engine=EngineConfig(max_schema_bytes=raised))
    async with open_client(engine, settings) as client:
        route, body = chat(response_format=json_schema_format(100_000))
        assert (await client.post(route, json=body)).status_code == 200
        route, body = chat(response_format=json_schema_format(raised + 1))
        assert str(raised) in assert_refused(await client.post(route, json=body), "response_format")


def test_max_schema_bytes_cannot_pass_the_ceiling() -> None:
    EngineConfig(max_schema_bytes=MAX_SCHEMA_BYTES_CEILING)
    with pytest.raises(ParamError, match="max_schema_bytes") as raised:
        EngineConfig(max_schema_bytes=MAX_SCHEMA_BYTES_CEILING + 1)
    assert str(MAX_SCHEMA_BYTES_CEILING) in str(raised.value)


@pytest.mark.parametrize("make", [lambda k: chat(n=k), lambda k: completion(n=k)])
async def test_n_past_max_num_seqs_is_a_400_naming_n(engine: FakeEngine, make) -> None:
    """A prompt's choices run as one batch: n above max_num_seqs could never be scheduled, so
    it is refused at the edge (the engine would fail it: a 500)."""
    settings = Settings(engine=EngineConfig(max_num_seqs=4))
    async with open_client(engine, settings) as client:
        route, body = make(4)
        assert (await client.post(route, json=body)).status_code == 200
        route, body = make(5)
        message = assert_refused(await client.post(route, json=body), "n")
        assert "max_num_seqs" in message
