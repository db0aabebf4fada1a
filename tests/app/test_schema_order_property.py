"""Property: random nested schemas ($defs and $ref, arrays, enums, any key order), as forced
tool parameters and as response_format, compiled by xgrammar as the engine compiles them and
walked with seeded random choices among the tokens each mask allows, always give JSON that
validates (jsonschema) and lists every object's keys in the schema's property order."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from app.openai.request_parts import NamedToolChoice, Tool
from app.openai.structured_output import structured_output, tool_structured_output
from tests.app.schema_walk import check_key_order, compiler, pairs_in_order, walk

NAMES = st.sampled_from(["zeta", "alpha", "mid", "b", "a", "reasoning", "answer", "x_1"])
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 9}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 3)),
    st.lists(
        st.sampled_from(["red", "green", "blue", "x"]), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(properties: dict[str, Any], num_required: int) -> dict[str, Any]:
        names = list(properties)
        return {
            "type": "object",
            "properties": properties,
            "required": names[:num_required],
            "additionalProperties": False,
        }

    props = st.dictionaries(NAMES, children, min_size=1, max_size=4)
    return st.builds(build, props, st.integers(0, 4))


def _array(children: st.SearchStrategy) -> st.SearchStrategy:
    return children.map(lambda item: {"type": "array", "items": item, "maxItems": 2})


NODES = st.recursive(LEAVES, lambda inner: st.one_of(_object(inner), _array(inner)), max_leaves=8)


@st.composite
def schemas(draw) -> dict[str, Any]:
    """An object schema whose properties may point ($ref) at named definitions, some of
    which point at each other (defined before, so nothing recurses without end)."""
    definitions: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(["Addr", "Item", "Z", "A"]), unique=True)):
        node = draw(NODES)
        if definitions and draw(st.booleans()):
            other = draw(st.sampled_from(sorted(definitions)))
            node = {"type": "object", "properties": {"inner": {"$ref": f"#/$defs/{other}"}}}
            node |= {"required": ["inner"], "additionalProperties": False}
        definitions[name] = node
    refs = [st.just({"$ref": f"#/$defs/{name}"}) for name in definitions]
    root = draw(_object(st.one_of(NODES, *refs)))
    if definitions:
        root = (
            {"$defs": definitions, **root}
            if draw(st.booleans())
            else {**root, "$defs": definitions}
        )
    return root


def _compile_and_walk(text: str, seed: int) -> Any:
    compiled = compiler().compile_json_schema(text, any_whitespace=False, strict_mode=True)
    return pairs_in_order(walk(compiled, seed))


PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@PROPERTY
@given(schemas(), st.integers(0, 2**31))
def test_response_format_output_validates_in_schema_order(schema, seed):
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    instance = _compile_and_walk(structured_output(rf).schema, seed)
    Draft202012Validator(schema).validate(instance)
    check_key_order(instance, schema, schema)


def _tool(name: str, parameters: dict[str, Any]) -> Tool:
    return Tool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": parameters}}
    )


@PROPERTY
@given(
    schemas(), schemas(), st.sampled_from(["named", "required", "parallel"]), st.integers(0, 2**31)
)
def test_forced_tool_call_arguments_validate_in_schema_order(first, second, mode, seed):
    tools = [_tool("first", first), _tool("second", second)]
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "second"}})
    structured = tool_structured_output(
        tools, "named" if mode == "named" else "required", choice, parallel=mode == "parallel"
    )
    output = _compile_and_walk(structured.schema, seed)
    calls = output if mode == "parallel" else [output]
    by_name = {"first": first, "second": second}
    for call in calls:
        assert list(call) == ["name", "arguments"]
        assert mode != "named" or call["name"] == "second"
        parameters = by_name[call["name"]]
        Draft202012Validator(parameters).validate(call["arguments"])
        check_key_order(call["arguments"], parameters, parameters)


def test_walk_is_seeded():
    """Same seed, same walk; the property above is reproducible."""
    text = json.dumps(
        {"type": "object", "properties": {"z": {"type": "integer", "minimum": 0, "maximum": 999}}}
    )
    compiled = compiler().compile_json_schema(text, any_whitespace=False, strict_mode=True)
    assert walk(compiled, 7) == walk(compiled, 7)
    assert isinstance(xgr.GrammarMatcher(compiled), xgr.GrammarMatcher)
