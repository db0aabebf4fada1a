"""/openapi.json tells the truth: the statuses each route really sends are declared, with the
OpenAI error envelope; the bounds on request fields are the ones the server enforces.

The checks go both ways: a status provoked from a route must be in the document, and a bound
read from the document must be where the server starts refusing (one past it: a 400 naming
the field; at it: served).
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from fake_engine import FakeEngine
from helpers import chat_body, make_settings, open_client
from jsonschema import Draft202012Validator
from openai_schemas import assert_valid

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REQUEST_SCHEMAS = {CHAT: "ChatCompletionRequest", COMPLETIONS: "CompletionRequest"}


async def document(client) -> dict:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def declared(doc: dict, path: str, method: str) -> dict[str, dict]:
    return doc["paths"][path][method]["responses"]


def error_schema_validator(doc: dict) -> Draft202012Validator:
    """The document's own ErrorResponse schema, its references resolved inside the document."""
    schema = {"$ref": "#/components/schemas/ErrorResponse", "components": doc["components"]}
    return Draft202012Validator(schema)


async def test_every_error_response_is_the_envelope_and_422_is_gone(client) -> None:
    doc = await document(client)
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)  # validation errors are 400s
            errors = {status for status in responses if not status.startswith("2")}
            assert errors, (path, method)
            for status in errors:
                schema = responses[status]["content"]["application/json"]["schema"]
                envelope = "AnthropicErrorResponse" if "/messages" in path else "ErrorResponse"
                assert schema == {"$ref": f"#/components/schemas/{envelope}"}
                assert responses[status]["description"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]


async def test_generation_routes_declare_json_and_event_stream(client) -> None:
    doc = await document(client)
    for path, final in ((CHAT, "ChatCompletionResponse"), (COMPLETIONS, "CompletionResponse")):
        ok = declared(doc, path, "post")["200"]
        assert ok["content"]["application/json"]["schema"]["$ref"].endswith(final)
        event_schema = ok["content"]["text/event-stream"]["schema"]
        # An event as an SSE parser (schemathesis) yields it, and the document's schema agree.
        jsonschema.validate({"event": "message_start", "data": '{"type": "x"}'}, event_schema)
        jsonschema.validate({"data": "[DONE]"}, event_schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate("data: [DONE]", event_schema)
        statuses = set(declared(doc, path, "post"))
        assert {"400", "404", "413", "429", "500", "503"} <= statuses
        assert "401" not in statuses  # no api_keys configured


async def test_api_keys_add_401_and_the_bearer_scheme(engine: FakeEngine) -> None:
    async with open_client(engine, make_settings(api_keys=("k1",))) as client:
        doc = await document(client)
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert "401" not in declared(doc, "/debug/faults", "post")  # the operator's: 403
        assert "403" in declared(doc, "/debug/kv_blocks", "get")
        for path in (CHAT, COMPLETIONS, "/v1/models", "/debug/cache_report"):
            operation = doc["paths"][path]["post" if "completions" in path else "get"]
            assert "401" in operation["responses"]
            assert operation["security"] == [{"bearer": []}, {"apiKey": []}]
        assert doc["components"]["securitySchemes"]["apiKey"]["name"] == "x-api-key"
        messages = declared(doc, "/v1/messages", "post")["401"]["content"]["application/json"]
        assert messages["schema"]["$ref"].endswith("/AnthropicErrorResponse")
        assert "401" not in declared(doc, "/health", "get")
        response = await client.post(CHAT, json=chat_body())
        assert response.status_code == 401
        assert error_schema_validator(doc).is_valid(response.json())


# (how to provoke it, path template, method): the status a route really sends
async def _provoke(tokenizer_dir: Path, case: str):
    engine = FakeEngine(tokenizer_dir)
    settings = make_settings()
    if case == "413":
        settings = make_settings(max_body_bytes=1024)
    async with open_client(engine, settings) as client:
        if case == "400":
            return await client.post(CHAT, json=chat_body(temperature=5)), CHAT, "post"
        if case == "400-json":
            return await client.post(COMPLETIONS, content=b"{"), COMPLETIONS, "post"
        if case == "404-model":
            return await client.post(CHAT, json=chat_body() | {"model": "x"}), CHAT, "post"
        if case == "404-card":
            return await client.get("/v1/models/nope"), "/v1/models/{model}", "get"
        if case == "413":
            body = chat_body("x" * 2000)
            return await client.post(CHAT, json=body), CHAT, "post"
        if case == "429":
            engine.waiting = 10_000
            return await client.post(COMPLETIONS, json={"prompt": "hi"}), COMPLETIONS, "post"
        if case == "503":
            client.app.state.kvshare.begin_drain()
            return await client.get("/v1/models"), "/v1/models", "get"
        if case == "403":
            return await client.post("/debug/faults", json={"kind": "x"}), "/debug/faults", "post"
        if case == "404-kv":
            return await client.get("/debug/kv_blocks"), "/debug/kv_blocks", "get"
        if case == "503-ready":
            client.app.state.kvshare.begin_drain()
            return await client.get("/ready"), "/ready", "get"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["400", "400-json", "404-model", "404-card", "413", "429", "503", "403", "404-kv", "503-ready"],
)
async def test_a_status_a_route_sends_is_declared_and_its_body_conforms(
    tokenizer_dir: Path, case: str
) -> None:
    response, path, method = await _provoke(tokenizer_dir, case)
    assert response.status_code == int(case.split("-")[0]), response.text
    async with open_client(FakeEngine(tokenizer_dir)) as client:
        doc = await document(client)
    assert str(response.status_code) in declared(doc, path, method)
    assert error_schema_validator(doc).is_valid(response.json())
    assert_valid("ErrorResponse", response.json())  # and OpenAI's own envelope schema


def _numeric_bounds(doc: dict, schema_name: str) -> list[tuple[str, str, float, str]]:
    """(field, keyword, bound, JSON type) for every top-level numeric bound in a request schema."""
    bounds = []
    properties = doc["components"]["schemas"][schema_name]["properties"]
    for field, schema in properties.items():
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") not in ("integer", "number"):
                continue
            for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if keyword in branch:
                    bounds.append((field, keyword, branch[keyword], branch["type"]))
    return bounds


def _body(path: str, field: str, value: float) -> dict:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    base = chat_body(max_tokens=2) if path == CHAT else {"prompt": "hi", "max_tokens": 2}
    if field in ("max_tokens", "max_completion_tokens"):
        base.pop("max_tokens")
    return {**base, **extra, field: value}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_each_declared_numeric_bound_is_where_the_server_refuses(
    tokenizer_dir: Path, path: str
) -> None:
    """Read from the document: the bound itself is served (unless exclusive), one step past it
    is a 400 naming the field. Small caps keep the served requests cheap."""
    settings = make_settings(max_n=3, max_output_tokens=5, max_top_logprobs=4)
    async with open_client(FakeEngine(tokenizer_dir, max_model_len=64), settings) as client:
        doc = await document(client)
        bounds = _numeric_bounds(doc, REQUEST_SCHEMAS[path])
        fields = {field for field, *_ in bounds}
        assert {"temperature", "top_p", "n", "max_tokens", "seed", "presence_penalty"} <= fields
        for field, keyword, bound, kind in bounds:
            step = 1 if kind == "integer" else 0.01
            past = bound + step if "aximum" in keyword else bound - step
            response = await client.post(path, json=_body(path, field, past))
            assert response.status_code == 400, (field, keyword, past, response.text)
            assert response.json()["error"]["param"] == field
            at = _body(path, field, bound)
            response = await client.post(path, json=at)
            if keyword.startswith("exclusive"):
                assert response.status_code == 400, (field, keyword, bound)
            else:
                assert response.status_code == 200, (field, keyword, bound, response.text)


async def test_the_document_carries_this_servers_caps(engine: FakeEngine) -> None:
    settings = make_settings(max_n=7, max_stop_strings=3, max_messages=9, max_tools=4)
    async with open_client(engine, settings) as client:
        doc = await document(client)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 7} in chat["n"]["anyOf"]
    arrays = [branch for branch in chat["stop"]["anyOf"] if branch.get("type") == "array"]
    assert arrays[0]["maxItems"] == 3
    assert chat["messages"]["maxItems"] == 9
    assert [b["maxItems"] for b in chat["tools"]["anyOf"] if b.get("type") == "array"] == [4]
    temperature = next(b for b in chat["temperature"]["anyOf"] if b.get("type") == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
