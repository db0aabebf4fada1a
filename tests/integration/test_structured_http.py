"""json_schema over HTTP on a real `kvshare serve`: a table of schemas sampled at temperature 1,
and seeded constrained requests that give the same content alone, in a busy batch, with and
without the prefix cache, streamed or not.

Every schema is bounded (short enums, small integer ranges, maxLength, fixed-length patterns,
maxItems), so a conforming output ends well inside max_tokens and must finish with "stop".
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from benchmarks.structured_schemas import SCHEMAS
from tests.integration.server import running_server

pytestmark = pytest.mark.integration

MAX_TOKENS = 200
SEEDS = (3, 17)
CHOICES = 3
WORKERS = 8  # requests in flight at once (the engine batches them)


def _response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _messages(ask: str) -> list[dict]:
    return [{"role": "user", "content": ask}]


def _constrained(client, model, index: int, seed: int, **fields):
    name, ask, schema = SCHEMAS[index]
    return client.chat.completions.create(
        model=model,
        messages=_messages(ask),
        response_format=_response_format(name, schema),
        temperature=1.0,
        top_p=1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
        **fields,
    )


def test_every_schema_validates_at_temperature_one(client, model):
    cases = [(index, seed) for index in range(len(SCHEMAS)) for seed in SEEDS]
    with ThreadPoolExecutor(WORKERS) as pool:
        completions = list(
            pool.map(lambda case: _constrained(client, model, *case, n=CHOICES), cases)
        )
    failures = []
    for (index, seed), completion in zip(cases, completions, strict=True):
        name, _, schema = SCHEMAS[index]
        assert len(completion.choices) == CHOICES
        for choice in completion.choices:
            where = f"{name} seed={seed} choice={choice.index}"
            content = choice.message.content
            if choice.finish_reason != "stop":
                failures.append(f"{where}: finish_reason {choice.finish_reason!r}: {content!r}")
                continue
            try:
                jsonschema.validate(json.loads(content), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as error:
                failures.append(f"{where}: {type(error).__name__}: {error}: {content!r}")
    assert not failures, "\n".join(failures)


def _target(client, model) -> list[str]:
    """The choices of one seeded json_schema request (n=2)."""
    completion = _constrained(client, model, 0, 1234, n=2)
    assert all(choice.finish_reason == "stop" for choice in completion.choices)
    return [choice.message.content for choice in completion.choices]


def _content_alone_and_beside_others(client, model) -> tuple[list[str], list[str]]:
    """_target run alone, then beside 8 others (4 free text, 4 other schemas)."""

    def free(seed: int):
        return client.chat.completions.create(
            model=model,
            messages=_messages(f"Write a short story about the number {seed}."),
            temperature=1.0,
            seed=seed,
            max_tokens=48,
        )

    alone = _target(client, model)
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(free, seed) for seed in range(4)]
        others += [pool.submit(_constrained, client, model, i, 99 + i) for i in (2, 5, 7, 9)]
        busy = pool.submit(_target, client, model)
        for other in others:
            other.result()
        return alone, busy.result()


def test_seeded_json_schema_is_batch_invariant_with_prefix_cache(client, model):
    alone, busy = _content_alone_and_beside_others(client, model)
    assert busy == alone
    jsonschema.validate(json.loads(alone[0]), SCHEMAS[0][2])


def test_seeded_json_schema_is_batch_invariant_without_prefix_cache(client, model):
    with running_server("--no-prefix-cache") as url:
        off = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        alone, busy = _content_alone_and_beside_others(off, model)
    assert busy == alone
    # Same seed, same model: the prefix cache changes nothing either.
    assert alone == _target(client, model)


def test_seeded_json_schema_stream_equals_non_stream(client, model):
    index = 9  # array_of_objects: strings, nesting and an array
    full = _constrained(client, model, index, 42, n=2)
    streamed = ["", ""]
    finish = [None, None]
    for chunk in _constrained(client, model, index, 42, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert streamed == [choice.message.content for choice in full.choices]
    assert finish == [choice.finish_reason for choice in full.choices] == ["stop", "stop"]
    for content in streamed:
        jsonschema.validate(json.loads(content), SCHEMAS[index][2])
