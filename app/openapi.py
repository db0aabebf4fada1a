"""The app's OpenAPI document (/openapi.json), made to tell the truth.

FastAPI's own document knows only the 200s and a 422 this server never sends (validation
errors are 400s, app/errors.py). Here every status a route can return is declared with the
OpenAI error envelope as its schema, the request caps the server enforces (app/serving/limits.py,
from this app's settings) are written onto the request schemas, and the bearer scheme is
declared when API keys are configured. The ranges that never change (temperature 0..2, ...)
come from the pydantic fields themselves (app/openai/request_models.py).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from app.errors import ANTHROPIC_PREFIX
from app.serving.limits import RequestLimits
from app.settings import Settings
from app.streaming import SSE_EVENT_SCHEMA
from engine.core.seeds import MAX_SEED


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every non-2xx answer of this server has this body, but on
    Anthropic's routes."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope: the non-2xx body of /v1/messages and its count_tokens."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# Why a status is sent (the description of each declared response).
_REASONS = {
    400: "Invalid request: `param` (or the message) names the field.",
    401: "Missing or invalid API key (`Authorization: Bearer <key>`).",
    403: "Fault injection is disabled on this server, or the route is the operator's and no"
    " operator_keys are set.",
    404: "Unknown model (`param` is `model`), an unknown, deleted, expired or other tenant's"
    " stored response, or a disabled feature.",
    409: "No cached block to aim the fault drill at.",
    413: "The request body is larger than max_body_bytes.",
    429: "The waiting queue is full (max_waiting_requests); retry after `Retry-After`.",
    500: "The engine failed this request (others go on) or an unexpected error.",
    503: "The model is still loading, failed to load, or the server is draining.",
}
_GENERATION = (400, 404, 413, 429, 500, 503)
_COUNTING = (400, 404, 413, 500, 503)  # token counts: ready, never queued (no 429)
# (path, method) -> the error statuses the route itself can send; 401 is added to keyed
# routes when API keys are configured, 413 to every POST (the body limit comes first).
ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/chat/completions", "post"): _GENERATION,
    ("/v1/completions", "post"): _GENERATION,
    ("/v1/responses", "post"): _GENERATION,
    ("/v1/responses/{response_id}", "get"): (400, 404, 500, 503),
    ("/v1/responses/{response_id}", "delete"): (400, 404, 500, 503),
    ("/v1/responses/{response_id}/input_items", "get"): (400, 404, 500, 503),
    ("/v1/responses/input_tokens", "post"): _COUNTING,
    ("/v1/messages", "post"): _GENERATION,
    ("/v1/messages/count_tokens", "post"): _COUNTING,
    ("/tokenize", "post"): _COUNTING,
    ("/detokenize", "post"): _COUNTING,
    ("/v1/models", "get"): (500, 503),
    ("/v1/models/{model}", "get"): (404, 500, 503),
    ("/health", "get"): (500,),
    ("/ready", "get"): (500, 503),
    ("/metrics", "get"): (500,),
    ("/debug/faults", "post"): (400, 403, 409, 413, 500, 503),
    ("/debug/kv_blocks", "get"): (404, 500, 503),
    ("/debug/cache_report", "get"): (400, 404, 500, 503),
}
# app/middleware.py's ApiKeyMiddleware guards these, but the operator's (OperatorKeyMiddleware)
KEYED_PREFIXES = ("/v1/", "/debug/", "/tokenize", "/detokenize")
OPERATOR_PATHS = ("/metrics", "/debug/faults", "/debug/kv_blocks")
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}


def stream_responses(final: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
    """The 200 of a generation route: `final` as JSON, or SSE whose data lines are `chunk`s."""
    description = (
        f"`{final.__name__}`; with `stream: true`, Server-Sent Events: `data: <{chunk.__name__}>`"
        " lines, ending with `data: [DONE]`."
    )
    sse = {"schema": SSE_EVENT_SCHEMA}
    return {
        200: {"model": final, "description": description, "content": {"text/event-stream": sse}}
    }


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Replace app.openapi with the truthful document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            declare_errors(document, settings)
            declare_shapes(document)
            declare_limits(document, RequestLimits.of(settings.server, settings.engine))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def declare_errors(document: dict[str, Any], settings: Settings) -> None:
    """Every route's error statuses with the envelope; FastAPI's 422 (never sent) removed."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_model_schemas(ErrorResponse))
    schemas.update(_model_schemas(AnthropicErrorResponse))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    keyed = bool(settings.server.api_keys)
    operator = bool(settings.server.operator_keys)
    if keyed:
        scheme = {"type": "http", "scheme": "bearer", "description": "One of api_keys."}
        header = {"type": "apiKey", "in": "header", "name": "x-api-key"}
        header["description"] = "One of api_keys (Anthropic's clients send it so)."
        document["components"]["securitySchemes"] = {"bearer": scheme, "apiKey": header}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            statuses = set(ROUTE_ERRORS.get((path, method), (500,)))
            if method == "post":
                statuses.add(413)
            if path in OPERATOR_PATHS:
                statuses |= {401} if operator else {403} if keyed and path != "/metrics" else set()
            elif keyed and path.startswith(KEYED_PREFIXES):
                statuses.add(401)
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            envelope = _ANTHROPIC_ERROR_REF if path.startswith(ANTHROPIC_PREFIX) else _ERROR_REF
            for status in sorted(statuses):
                content = {"application/json": {"schema": envelope}}
                responses[str(status)] = {"description": _REASONS[status], "content": content}


def declare_limits(document: dict[str, Any], limits: RequestLimits) -> None:
    """Write the caps of app/serving/limits.py onto the request schemas (the server refuses
    past them with a 400 naming the field)."""
    schemas = document.get("components", {}).get("schemas", {})
    _integer_bounds(schemas)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schemas.get(name, {}).get("properties", {})
        _bound(properties.get("seed"), "integer", maximum=MAX_SEED)  # exact, not 2.0**63
        _bound(properties.get("n"), "integer", maximum=min(limits.max_n, limits.max_num_seqs))
        _bound(properties.get("max_tokens"), "integer", maximum=limits.max_output_tokens)
        _bound(properties.get("logit_bias"), "object", maxProperties=limits.max_logit_bias_entries)
        _bound(properties.get("stop_token_ids"), "array", maxItems=limits.max_stop_token_ids)
        stop = properties.get("stop")
        _bound(stop, "string", maxLength=limits.max_stop_string_chars)
        _bound(stop, "array", maxItems=limits.max_stop_strings)
        for branch in _branches(stop, "array"):
            branch.setdefault("items", {})["maxLength"] = limits.max_stop_string_chars
    chat = schemas.get("ChatCompletionRequest", {}).get("properties", {})
    _bound(chat.get("max_completion_tokens"), "integer", maximum=limits.max_output_tokens)
    _bound(chat.get("top_logprobs"), "integer", maximum=limits.max_top_logprobs)
    _bound(chat.get("messages"), "array", maxItems=limits.max_messages)
    _bound(chat.get("tools"), "array", maxItems=limits.max_tools)
    completion = schemas.get("CompletionRequest", {}).get("properties", {})
    _bound(completion.get("logprobs"), "integer", maximum=limits.max_top_logprobs)
    for branch in _branches(completion.get("prompt"), "array"):
        if branch.get("items", {}).get("type") != "integer":  # a list of prompts, not of ids
            branch["maxItems"] = limits.max_prompts


def declare_shapes(document: dict[str, Any]) -> None:
    """What the server checks beyond the pydantic types, where JSON Schema can say it: which
    messages need content or a tool_call_id (ChatMessage.check), and that prompts and stop
    strings are not empty (engine/core/validation.py, SamplingParams)."""
    schemas = document.get("components", {}).get("schemas", {})
    if "ChatMessage" in schemas:
        schemas["ChatMessage"]["anyOf"] = _message_variants()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        stop = schemas.get(name, {}).get("properties", {}).get("stop")
        _bound(stop, "string", minLength=1)
        for branch in _branches(stop, "array"):
            branch.setdefault("items", {})["minLength"] = 1
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    _bound(prompt, "string", minLength=1)
    _bound(prompt, "array", minItems=1)
    for branch in _branches(prompt, "array"):
        items = branch.get("items", {})
        items.update(
            {"string": {"minLength": 1}, "integer": {"minimum": 0}}.get(items.get("type"), {})
        )
        if items.get("type") == "array":
            items["minItems"] = 1
            items.setdefault("items", {})["minimum"] = 0


def _message_variants() -> list[dict[str, Any]]:
    """A message by role: content required but for an assistant's that calls tools; a tool
    message answers a call by its id; only an assistant's carries tool calls."""
    content = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}},
        ]
    }
    no_calls = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    calls = {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ToolCall"}}
    roles = {"enum": ["system", "developer", "user"]}
    return [
        {
            "properties": {"role": roles, "content": content, "tool_calls": no_calls},
            "required": ["role", "content"],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": content,
                "tool_call_id": {"type": "string", "minLength": 1},
                "tool_calls": no_calls,
            },
            "required": ["role", "content", "tool_call_id"],
        },
        {
            "properties": {"role": {"const": "assistant"}, "content": content},
            "required": ["role", "content"],
        },
        {
            "properties": {"role": {"const": "assistant"}, "tool_calls": calls},
            "required": ["role", "tool_calls"],
        },
    ]


def _branches(schema: dict[str, Any] | None, type_name: str) -> list[dict[str, Any]]:
    """The parts of `schema` (itself, or its anyOf members) of JSON type `type_name`."""
    if schema is None:
        return []
    members = schema.get("anyOf", [schema])
    return [member for member in members if member.get("type") == type_name]


def _bound(schema: dict[str, Any] | None, type_name: str, **keywords: int) -> None:
    for branch in _branches(schema, type_name):
        branch.update(keywords)


def _integer_bounds(node: Any) -> None:
    """FastAPI's document model stores bounds as floats (1.0); an integer's are ints again."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _integer_bounds(value)


def _model_schemas(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema and those it refers to, as OpenAPI components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    nested = schema.pop("$defs", {})
    return {model.__name__: schema, **nested}
