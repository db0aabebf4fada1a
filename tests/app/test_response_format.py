"""response_format on chat and completions: each accepted form reaches the engine as its
StructuredOutput; each bad one is a 400 with param response_format that names the problem."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from helpers import chat_body, spy_schema_serializations
from openai_schemas import assert_valid

from app.openai.json_schema import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    SchemaRefused,
    canonical_json,
    check_schema,
)
from engine.core.sampling_params import StructuredOutput

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green"]},
        "count": {"type": "integer", "minimum": 0},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
CANONICAL = (
    '{"additionalProperties":false,"properties":{"colour":{"enum":["red","green"],'
    '"type":"string"},"count":{"minimum":0,"type":"integer"}},'
    '"required":["colour","count"],"type":"object"}'
)


def json_schema(schema: object = SCHEMA, **spec: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **spec}}


def body_for(url: str, response_format: object) -> dict:
    if url == CHAT:
        return chat_body(response_format=response_format)
    return {"prompt": "Hello", "response_format": response_format}


ACCEPTED = [
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredOutput("json_object")),
    (json_schema(), StructuredOutput("json_schema", CANONICAL)),
    (json_schema(strict=True), StructuredOutput("json_schema", CANONICAL)),
    (json_schema(strict=False), StructuredOutput("json_schema", CANONICAL)),
    (json_schema(strict=None, description="a colour"), StructuredOutput("json_schema", CANONICAL)),
]


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("response_format", "expected"), ACCEPTED)
async def test_accepted_form_reaches_the_engine(
    client, engine: FakeEngine, url, response_format, expected
):
    response = await client.post(url, json=body_for(url, response_format))
    assert response.status_code == 200, response.text
    assert [r.sampling_params.structured for r in engine.requests] == [expected]


async def test_no_response_format_means_no_constraint(client, engine: FakeEngine):
    assert (await client.post(CHAT, json=chat_body())).status_code == 200
    assert engine.requests[0].sampling_params.structured is None


async def test_equal_schemas_give_equal_text(client, engine: FakeEngine):
    reordered = dict(reversed(list(SCHEMA.items())))
    for schema in (SCHEMA, reordered):
        assert (
            await client.post(CHAT, json=chat_body(response_format=json_schema(schema)))
        ).status_code == 200
    assert {r.sampling_params.structured.schema for r in engine.requests} == {CANONICAL}


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
async def test_the_schema_is_serialized_once_per_request(
    client, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, url
):
    """One canonical text serves the size cap (app/serving/limits.py), the keyword check and the
    engine: the schema is serialized once."""
    serialized = spy_schema_serializations(monkeypatch)
    response = await client.post(url, json=body_for(url, json_schema()))
    assert response.status_code == 200, response.text
    assert serialized == [SCHEMA]
    assert engine.requests[0].sampling_params.structured.schema == CANONICAL


async def test_streamed_request_carries_the_constraint(client, engine: FakeEngine):
    body = chat_body(response_format={"type": "json_object"}, stream=True)
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert engine.requests[0].sampling_params.structured == StructuredOutput("json_object")


DEEP: dict = {"type": "array"}
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "array", "items": DEEP}
BIG = {  # over the default max_schema_bytes (and the ceiling): app/serving/limits.py refuses it
    "type": "object",
    "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 20)},
}

# (response_format, words the message must contain)
REFUSED = [
    ("json_object", ['"text", "json_object" or "json_schema"']),
    ({"type": "xml"}, ["'xml'"]),
    (
        {"type": "json_object", "json_schema": {"name": "a", "schema": {}}},
        ['"json_object"', "'json_schema'"],
    ),
    ({"type": "text", "json_schema": {"name": "a", "schema": {}}}, ['"text"', "'json_schema'"]),
    ({"type": "json_schema"}, ["json_schema is required"]),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, ["needs json_schema.schema"]),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, ["json_schema.name is required"]),
    (json_schema() | {"json_schema": {"name": "no spaces", "schema": SCHEMA}}, ["name", "pattern"]),
    (json_schema(strict="yes"), ["strict"]),
    (json_schema(extra=1), ["'extra'"]),
    (json_schema([1]), ["schema", "dictionary"]),
    (json_schema({"type": "objekt"}), ["not a valid JSON Schema", "'/type'"]),
    (json_schema({"type": "string", "minLength": -1}), ["not a valid JSON Schema", "minLength"]),
    (json_schema(BIG), ["bytes of JSON", "max_schema_bytes"]),
    (json_schema(DEEP), [f"the limit is {MAX_SCHEMA_DEPTH}"]),
    (
        json_schema(
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
        ),
        ["'uniqueItems'", "'/properties/tags'"],
    ),
    (json_schema({"type": "object", "patternProperties": {"^x": {}}}), ["'patternProperties'"]),
    (json_schema({"type": "object", "dependentRequired": {"a": ["b"]}}), ["'dependentRequired'"]),
    (json_schema({"type": "integer", "not": {"const": 1}}), ["'not'"]),
    (json_schema({"if": {"type": "string"}, "then": {"minLength": 1}}), ["'if'"]),
    (json_schema({"type": "array", "contains": {"type": "integer"}}), ["'contains'"]),
    (json_schema({"oneOf": [{"type": "integer"}, {"type": "string"}]}), ["'oneOf'", "anyOf"]),
    (json_schema({"type": "number", "multipleOf": 0.5}), ["'multipleOf'", "integer"]),
    (json_schema({"type": "string", "format": "byte"}), ["'format'", "byte"]),
    (json_schema({"minLength": 1}), ["'minLength'", '"type": "string"']),
    (json_schema({"type": "object", "required": ["a"]}), ["'required'", "'a'"]),
    (json_schema({"$ref": "https://example.com/s.json"}), ["'$ref'"]),
    (json_schema({"type": "object", "nullable": True}), ["'nullable'"]),
]


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("response_format", "words"), REFUSED)
async def test_bad_response_format_is_a_400_naming_it(
    client, engine: FakeEngine, url, response_format, words
):
    response = await client.post(url, json=body_for(url, response_format))
    assert response.status_code == 400, response.text
    body = response.json()
    assert_valid("ErrorResponse", body)
    assert body["error"]["param"] == "response_format"
    assert body["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in body["error"]["message"]
    assert engine.requests == []


async def test_other_unsupported_fields_stay_refused(client):
    body = chat_body(response_format={"type": "json_object"}, tools=[])
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"


async def test_openapi_documents_the_real_shape(client):
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    refs = json.dumps(schemas["ChatCompletionRequest"]["properties"]["response_format"])
    for name in ("ResponseFormatText", "ResponseFormatJsonObject", "ResponseFormatJsonSchema"):
        assert name in refs
        assert name in json.dumps(schemas["CompletionRequest"]["properties"]["response_format"])
    spec = schemas["JsonSchemaSpec"]
    assert spec["required"] == ["name"]
    assert set(spec["properties"]) == {"name", "description", "schema", "strict"}
    assert spec["properties"]["name"]["pattern"] == "^[a-zA-Z0-9_-]{1,64}$"


def test_check_schema_refuses_past_the_ceiling_whatever_the_setting() -> None:
    """The backstop behind the configured cap: a schema one byte over 1 MiB of canonical JSON."""
    base = len(canonical_json({"description": "", "type": "object"}))
    at_ceiling = {"type": "object", "description": "x" * (MAX_SCHEMA_BYTES - base)}
    assert len(check_schema(at_ceiling).encode()) == MAX_SCHEMA_BYTES
    with pytest.raises(SchemaRefused, match=f"the limit is {MAX_SCHEMA_BYTES}"):
        check_schema({**at_ceiling, "description": at_ceiling["description"] + "x"})
