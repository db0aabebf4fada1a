"""Forced tool calls over parameters that use $ref (what pydantic sends for nested models),
the property order every grammar writes, and refusals that name the field and never show
the grammar library's source files. Grammars are compiled by xgrammar as the engine does."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xgrammar as xgr
from helpers import chat_body

from app.openai.request_parts import NamedToolChoice, Tool
from app.openai.structured_output import structured_output, tool_structured_output
from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import ModelInfo
from engine.runtime.grammar import GrammarCache, tool_calls_tag
from tests.app.schema_walk import compiler, tokenizer_dir
from tests.json_tokenizer import EOS_TOKEN_ID

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "city": {"$ref": "#/$defs/City"}},
    "required": ["street", "city"],
    "additionalProperties": False,
}
# pydantic's shape: the nested models under $defs, one referring to another.
PERSON = {
    "$defs": {"Address": ADDRESS, "City": {"enum": ["Paris", "Oslo"]}},
    "type": "object",
    "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
    "additionalProperties": False,
}
# Same definition name, other meaning: each tool's refs must resolve in its own parameters.
ORDER = {
    "definitions": {"Address": {"type": "integer", "minimum": 1, "maximum": 9}},
    "type": "object",
    "properties": {"zeta": {"type": "boolean"}, "alpha": {"$ref": "#/definitions/Address"}},
    "required": ["zeta", "alpha"],
    "additionalProperties": False,
}
# A linked list: recursion through the root.
LINKED = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}
PERSON_ARGS = '{"name": "Al", "home": {"street": "Main", "city": "Oslo"}}'
ORDER_ARGS = '{"zeta": true, "alpha": 3}'
LINKED_ARGS = '{"v": 1, "next": {"v": 2, "next": null}}'


def _tools(*pairs: tuple[str, dict[str, Any]]) -> list[Tool]:
    return [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in pairs
    ]


TOOLS = _tools(("person", PERSON), ("order", ORDER), ("linked", LINKED))


def _accepts(text: str, instance: str) -> bool:
    compiled = compiler().compile_json_schema(text, any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(instance) and matcher.is_terminated()


def _call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "arguments": {arguments}}}'


@pytest.mark.parametrize(
    ("name", "arguments"), [("person", PERSON_ARGS), ("order", ORDER_ARGS), ("linked", LINKED_ARGS)]
)
def test_named_call_resolves_refs_in_its_own_parameters(name, arguments):
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})
    structured = tool_structured_output(TOOLS, "named", choice)
    assert _accepts(structured.schema, _call(name, arguments))


def test_required_calls_keep_same_named_definitions_apart():
    one = tool_structured_output(TOOLS, "required", None, parallel=False).schema
    many = tool_structured_output(TOOLS, "required", None, parallel=True).schema
    assert _accepts(one, _call("person", PERSON_ARGS))
    assert _accepts(one, _call("order", ORDER_ARGS))
    assert not _accepts(one, _call("order", '{"zeta": true, "alpha": {"street": "x"}}'))
    calls = [_call("order", ORDER_ARGS), _call("linked", LINKED_ARGS), _call("person", PERSON_ARGS)]
    assert _accepts(many, "[" + ", ".join(calls) + "]")


def test_forced_call_writes_properties_in_schema_order():
    structured = tool_structured_output(TOOLS[1:2], "required", None, parallel=False)
    assert _accepts(structured.schema, _call("order", ORDER_ARGS))
    assert not _accepts(structured.schema, _call("order", '{"alpha": 3, "zeta": true}'))


def test_response_format_writes_properties_in_schema_order():
    rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}
    text = structured_output(rf).schema
    assert _accepts(text, ORDER_ARGS)
    assert not _accepts(text, '{"alpha": 3, "zeta": true}')


def test_schemas_that_differ_only_in_keyword_order_share_one_grammar_key():
    shuffled = {key: ORDER[key] for key in reversed(ORDER)}
    first = structured_output(
        {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}
    )
    second = structured_output(
        {"type": "json_schema", "json_schema": {"name": "o", "schema": shuffled}}
    )
    assert first == second
    swapped = {
        **ORDER,
        "properties": {"alpha": ORDER["properties"]["alpha"], "zeta": {"type": "boolean"}},
    }
    third = structured_output(
        {"type": "json_schema", "json_schema": {"name": "o", "schema": swapped}}
    )
    assert third != first  # another property order is another grammar


def test_auto_structural_tag_resolves_refs():
    structured = tool_structured_output(TOOLS, "auto", None)
    compiled = compiler().compile_structural_tag(tool_calls_tag(structured.schema))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    text = f"Sure. <tool_call>\n{_call('person', PERSON_ARGS)}\n</tool_call>"
    assert matcher.accept_string(text)


@pytest.fixture(scope="module")
def cache():
    info = ModelInfo("tiny", str(tokenizer_dir()), 256, 256, (EOS_TOKEN_ID,), "v0")
    cache = GrammarCache(info, EngineConfig())
    yield cache
    cache.close()


# An absolute file path (not a JSON pointer, which follows '#'), or a source file's name.
SOURCE_NAME = re.compile(r"(?<![#\w~])/(?:[\w.-]+/)+[\w-]+\.\w+|\b[\w-]+\.(?:cc|cpp|h|hpp|py)\b")
# Schemas the edge's checker lets through but xgrammar refuses.
COMPILER_REFUSED = [
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 1}}},
]


@pytest.mark.parametrize("schema", COMPILER_REFUSED)
def test_compiler_refusal_names_the_tool_field_and_no_source_file(cache, schema):
    tools = _tools(("a", ORDER), ("b", schema))
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}})
    with pytest.raises(ParamError) as caught:
        cache.compile(tool_structured_output(tools, "named", choice))
    assert caught.value.param == "tools[1].function.parameters"
    assert str(caught.value).startswith("tools[1].function.parameters cannot be compiled")
    assert not SOURCE_NAME.search(str(caught.value)), str(caught.value)


@pytest.mark.parametrize("schema", COMPILER_REFUSED)
def test_compiler_refusal_of_response_format_is_clean(cache, schema):
    rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    with pytest.raises(ParamError) as caught:
        cache.compile(structured_output(rf))
    assert caught.value.param == "response_format"
    assert not SOURCE_NAME.search(str(caught.value)), str(caught.value)


BAD_BODIES = [
    {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/X"}}}
        ]
    },
    {
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "oneOf": []}},
            }
        ]
    },
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
    {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
        "tool_choice": "required",
    },
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": {"$ref": "#/x"}},
        }
    },
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": {"pattern": "("}},
        }
    },
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "xml"}},
    {
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
        "tools": [{"type": "function", "function": {"name": "f"}}],
    },
    {"temperature": "hot"},
    {"messages": "hi"},
]


@pytest.mark.anyio
@pytest.mark.parametrize("extra", BAD_BODIES)
async def test_no_refusal_shows_a_file_path_or_source_name(client, extra):
    response = await client.post("/v1/chat/completions", json={**chat_body("hi"), **extra})
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["message"]
    assert not SOURCE_NAME.search(json.dumps(response.json())), response.text
