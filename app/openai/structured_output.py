"""The engine's StructuredOutput for what a request asks of its output: a response_format
(README "Structured outputs") or a tool_choice other than "none" (README "Tools").

Each schema, response_format's or a tool's parameters, goes through check_schema
(app/openai/json_schema.py), so only keywords the grammar really enforces get through; whatever is
refused is a ParamError that names the field it came in.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.openai.json_schema import WHERE as SCHEMA_WHERE
from app.openai.json_schema import SchemaRefused, canonical_json, check_schema
from app.openai.request_parts import (
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


def response_format_schema(response_format: Any) -> Any:
    """The json_schema.schema inside a raw response_format, if there is one (the format
    itself is checked by structured_output)."""
    if not isinstance(response_format, dict):
        return None
    spec = response_format.get("json_schema")
    return spec.get("schema") if isinstance(spec, dict) else None


def structured_output(
    response_format: Any, schema_text: str | None = None
) -> StructuredOutput | None:
    """The engine's constraint for a raw `response_format` value; ParamError names the problem.
    `schema_text`: its schema's canonical text when the request has it already.

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
    return StructuredOutput("json_schema", check_schema(parsed.json_schema.schema_, schema_text))


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
    tools: list[Tool],
    mode: str,
    tool_choice: NamedToolChoice | str | None,
    parallel: bool = True,
    schema_texts: list[str | None] | None = None,
) -> StructuredOutput:
    """The grammar behind a tool_choice other than "none".

    "auto": text, where every `<tool_call>` must be completed as a valid call (kind
    "tool_calls"; each tool's parameters are their own root, so their refs resolve as
    written). "named": exactly `{"name": NAME, "arguments": ARGS}`. "required": one such
    object for any of the tools, or with parallel calls an array of 1 to
    MAX_PARALLEL_TOOL_CALLS of them (bounded, so that a model cannot add calls forever).
    The text keeps "name" before "arguments" (the grammar writes properties in schema order,
    and a streamed call starts with its name). In a forced call the parameters sit inside a
    wrapper, so a tool whose parameters hold a `$ref` is hoisted under the wrapper's `$defs`
    (see _hoisted). `schema_texts`: the tools' parameters as canonical text, when the request
    has them already (ChatCompletionRequest.tool_schema_texts).
    """
    texts = schema_texts if schema_texts is not None else [None] * len(tools)
    parameters = {
        tool.function.name: _tool_parameters(number, tool, text)
        for number, (tool, text) in enumerate(zip(tools, texts, strict=True))
    }
    if mode == "auto":
        listed = [{"name": name, "parameters": schema} for name, schema in parameters.items()]
        return StructuredOutput("tool_calls", canonical_json(listed), param="tools")
    numbers = {name: number for number, name in enumerate(parameters)}
    if mode == "named":
        assert isinstance(tool_choice, NamedToolChoice)
        names, param = [tool_choice.function.name], f"tools[{numbers[tool_choice.function.name]}]"
    else:
        names, param = list(parameters), "tools"
    definitions: dict[str, Any] = {}
    calls = []
    for name in names:
        arguments = _hoisted(parameters[name], f"kvshare_tool_{numbers[name]}", definitions)
        calls.append(_call_schema(name, arguments))
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if mode == "required" and parallel:
        schema = {"type": "array", "items": schema, "minItems": 1}
        schema["maxItems"] = MAX_PARALLEL_TOOL_CALLS
    if definitions:
        schema = {"$defs": definitions, **schema}
    param = f"{param}.function.parameters" if mode == "named" else param
    return StructuredOutput("json_schema", canonical_json(schema), param=param)


def _hoisted(parameters: dict[str, Any], key: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """The `arguments` schema of a call: the parameters themselves when they hold no `$ref`,
    else a `$ref` to `#/$defs/KEY`, where the parameters move with every local ref rewritten
    from their own root to that place (`#/$defs/A` -> `#/$defs/KEY/$defs/A`, `#` -> the
    parameters). Each tool has its own KEY, so tools whose `$defs` share names never collide,
    and refs between definitions and recursive refs keep pointing where they did."""
    prefix = f"#/$defs/{key}"
    rewritten, num_refs = _rewrite_refs(parameters, prefix)
    if num_refs == 0:
        return parameters
    definitions[key] = rewritten
    return {"$ref": prefix}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _rewrite_refs(node: Any, prefix: str, is_name_map: bool = False) -> tuple[Any, int]:
    """node with each local `$ref` ("#...") re-rooted under prefix, and how many there were.
    In a name map (properties, $defs) every value is a schema, whatever its name."""
    if isinstance(node, list):
        pairs = [_rewrite_refs(item, prefix) for item in node]
        return [item for item, _ in pairs], sum(count for _, count in pairs)
    if not isinstance(node, dict):
        return node, 0
    out: dict[str, Any] = {}
    total = 0
    for key, value in node.items():
        if is_name_map:
            out[key], count = _rewrite_refs(value, prefix)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key], count = prefix + value[1:], 1
        elif key in _DATA_KEYWORDS:
            out[key], count = value, 0
        else:
            out[key], count = _rewrite_refs(value, prefix, key in _NAME_MAPS)
        total += count
    return out, total


def _tool_parameters(number: int, tool: Tool, text: str | None) -> dict[str, Any]:
    """tools[number]'s parameters schema (`text`: its canonical text, if known), checked as
    response_format schemas are."""
    schema = tool.function.parameters
    if schema is None:
        return NO_ARGUMENTS
    param = f"tools[{number}].function.parameters"
    try:
        return json.loads(check_schema(schema, text))  # canonical: equal schemas, equal grammars
    except SchemaRefused as e:
        raise ParamError(param, e.message.replace(SCHEMA_WHERE, param)) from e


def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
