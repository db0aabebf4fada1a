"""The engine's StructuredOutput for what a request asks of its output: a response_format
(README "Structured outputs") or a tool_choice other than "none" (README "Tools").

Each schema, response_format's or a tool's parameters, goes through check_schema
(app/json_schema.py), so only keywords the grammar really enforces get through; whatever is
refused is a ParamError that names the field it came in.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.json_schema import WHERE as SCHEMA_WHERE
from app.json_schema import SchemaRefused, canonical_json, check_schema
from app.request_parts import (
    NamedToolChoice,
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatText,
    Tool,
)
from engine.core.errors import ParamError
from engine.core.sampling_params import StructuredOutput

MAX_PARALLEL_TOOL_CALLS = 8  # calls in one "required" answer with parallel_tool_calls
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

_RESPONSE_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponseFormat)


def structured_output(response_format: Any) -> StructuredOutput | None:
    """The engine's constraint for a raw `response_format` value; ParamError names the problem.

    Validated here rather than as a pydantic field so that every error says exactly what is
    wrong with response_format (the generic validation handler would only name the field).
    """
    if response_format is None:
        return None
    try:
        parsed = _RESPONSE_FORMAT.validate_python(response_format)
    except ValidationError as e:
        raise ParamError("response_format", _response_format_message(e, response_format)) from e
    if isinstance(parsed, ResponseFormatText):
        return None
    if isinstance(parsed, ResponseFormatJsonObject):
        return StructuredOutput("json_object")
    if parsed.json_schema.schema_ is None:
        message = 'response_format of type "json_schema" needs json_schema.schema (an object)'
        raise ParamError("response_format", message)
    return StructuredOutput("json_schema", check_schema(parsed.json_schema.schema_))


def _response_format_message(error: ValidationError, response_format: Any) -> str:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"][1:])  # [0] is the union tag
    kind = first["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found", "model_attributes_type"):
        given = response_format.get("type") if isinstance(response_format, dict) else None
        got = f", got {given!r}" if given is not None else ""
        return f'response_format.type must be "text", "json_object" or "json_schema"{got}'
    if kind == "extra_forbidden":
        owner = "json_schema" if loc.startswith("json_schema.") else f'type "{first["loc"][0]}"'
        field = loc.split(".")[-1]
        return f"response_format: {owner} takes no field '{field}'"
    if kind == "missing":
        return f"response_format.{loc} is required"
    return f"response_format.{loc}: {first['msg']}"


def tool_structured_output(
    tools: list[Tool], mode: str, tool_choice: NamedToolChoice | str | None, parallel: bool = True
) -> StructuredOutput:
    """The grammar behind a tool_choice other than "none".

    "auto": text, where every `<tool_call>` must be completed as a valid call (kind
    "tool_calls"). "named": exactly `{"name": NAME, "arguments": ARGS}`. "required": one such
    object for any of the tools, or with parallel calls an array of 1 to
    MAX_PARALLEL_TOOL_CALLS of them (bounded, so that a model cannot add calls forever).
    The text keeps "name" before "arguments" (the grammar writes properties in schema order,
    and a streamed call starts with its name); the parameters are canonical (sorted keys).
    """
    parameters = {
        tool.function.name: _tool_parameters(number, tool) for number, tool in enumerate(tools)
    }
    if mode == "auto":
        listed = [{"name": name, "parameters": schema} for name, schema in parameters.items()]
        return StructuredOutput("tool_calls", canonical_json(listed))
    calls = [_call_schema(name, schema) for name, schema in parameters.items()]
    if mode == "named":
        assert isinstance(tool_choice, NamedToolChoice)
        schema = _call_schema(tool_choice.function.name, parameters[tool_choice.function.name])
    else:
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if parallel:
            schema = {
                "type": "array",
                "items": schema,
                "minItems": 1,
                "maxItems": MAX_PARALLEL_TOOL_CALLS,
            }
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


def _tool_parameters(number: int, tool: Tool) -> dict[str, Any]:
    """tools[number]'s parameters schema, checked as response_format schemas are."""
    schema = tool.function.parameters
    if schema is None:
        return NO_ARGUMENTS
    param = f"tools[{number}].function.parameters"
    try:
        return json.loads(check_schema(schema))  # canonical: equal schemas, equal grammars
    except SchemaRefused as e:
        raise ParamError(param, e.message.replace(SCHEMA_WHERE, param)) from e


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
