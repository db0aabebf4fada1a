"""app/openai/json_schema.py's keyword table, proven against xgrammar (the engine's grammar
library).

Every keyword (and format) the table accepts has a case here: a schema the edge accepts, an
instance that conforms and one that violates it (jsonschema agrees), and xgrammar's matcher
takes the first and rejects the second. Every refusal has a case too: a violating instance that
xgrammar would let through, which is why the edge refuses it. This keeps the table honest when
xgrammar changes.
"""

from __future__ import annotations

import contextlib
import json
from functools import cache

import pytest
import xgrammar as xgr
from jsonschema import Draft202012Validator

from app.openai.json_schema import (
    ANNOTATIONS,
    DEFINITIONS,
    FORMATS,
    SUPPORTED,
    SchemaRefused,
    canonical_json,
    check_schema,
)

STR = {"type": "string"}
INT = {"type": "integer"}
DEFS = {"A": INT}

# keyword -> [(schema, conforming instance, violating instance)], instances as JSON text.
ENFORCED: dict[str, list[tuple[dict, str, str]]] = {
    "type": [
        (STR, '"a"', "1"),
        (INT, "1", "1.5"),
        ({"type": "number"}, "1.5", '"x"'),
        ({"type": "boolean"}, "true", "1"),
        ({"type": "null"}, "null", "0"),
        ({"type": "array"}, "[1]", "{}"),
        ({"type": "object"}, '{"a":1}', "[]"),
        ({"type": ["string", "null"]}, "null", "1"),
    ],
    "properties": [({"type": "object", "properties": {"a": INT}}, '{"a":1}', '{"a":"x"}')],
    "required": [
        ({"type": "object", "properties": {"a": STR}, "required": ["a"]}, '{"a":"x"}', "{}")
    ],
    "additionalProperties": [
        (
            {"type": "object", "properties": {"a": STR}, "additionalProperties": False},
            '{"a":"x"}',
            '{"a":"x","b":1}',
        ),
        ({"type": "object", "additionalProperties": INT}, '{"b":1}', '{"b":"x"}'),
    ],
    "unevaluatedProperties": [
        (
            {"type": "object", "properties": {"a": STR}, "unevaluatedProperties": INT},
            '{"b":1}',
            '{"b":"x"}',
        )
    ],
    "minProperties": [
        ({"type": "object", "additionalProperties": INT, "minProperties": 1}, '{"a":1}', "{}")
    ],
    "maxProperties": [
        (
            {"type": "object", "additionalProperties": INT, "maxProperties": 1},
            '{"a":1}',
            '{"a":1,"b":2}',
        )
    ],
    "items": [({"type": "array", "items": INT}, "[1,2]", '["x"]')],
    "prefixItems": [
        ({"type": "array", "prefixItems": [INT, STR], "items": False}, '[1,"a"]', '["a",1]')
    ],
    "unevaluatedItems": [
        ({"type": "array", "prefixItems": [STR], "unevaluatedItems": INT}, '["a",1]', '["a","b"]')
    ],
    "minItems": [({"type": "array", "items": STR, "minItems": 2}, '["a","b"]', '["a"]')],
    "maxItems": [({"type": "array", "items": STR, "maxItems": 1}, '["a"]', '["a","b"]')],
    "enum": [
        ({"enum": ["a", 1]}, "1", '"b"'),
        ({"type": "string", "enum": ["a", "b"]}, '"a"', '"c"'),
    ],
    "const": [({"const": "x"}, '"x"', '"y"')],
    "anyOf": [
        ({"anyOf": [STR, INT]}, "1", "true"),
        (
            {"anyOf": [{"type": "object", "properties": {"a": STR}, "required": ["a"]}]},
            '{"a":""}',
            "{}",
        ),
    ],
    "allOf": [({"allOf": [INT]}, "1", '"x"')],
    "$ref": [
        ({"$defs": DEFS, "$ref": "#/$defs/A"}, "1", '"x"'),
        (
            {
                "type": "object",
                "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                "required": ["c"],
            },
            '{"c":{"c":null}}',
            '{"c":1}',
        ),
    ],
    "$defs": [
        (
            {"$defs": DEFS, "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}},
            '{"a":1}',
            '{"a":"x"}',
        )
    ],
    "definitions": [
        (
            {
                "definitions": DEFS,
                "type": "object",
                "properties": {"a": {"$ref": "#/definitions/A"}},
            },
            '{"a":1}',
            '{"a":"x"}',
        )
    ],
    "minimum": [
        ({"type": "integer", "minimum": 3}, "3", "2"),
        ({"type": "number", "minimum": 1.5}, "1.5", "1.25"),
    ],
    "maximum": [
        ({"type": "integer", "maximum": 3}, "3", "4"),
        ({"type": "number", "maximum": 1.5}, "1.5", "1.75"),
    ],
    "exclusiveMinimum": [
        ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
        ({"type": "number", "exclusiveMinimum": 1.5}, "1.75", "1.5"),
    ],
    "exclusiveMaximum": [
        ({"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
        ({"type": "number", "exclusiveMaximum": 1.5}, "1.25", "1.5"),
    ],
    "multipleOf": [({"type": "integer", "multipleOf": 3}, "-6", "4")],
    "minLength": [
        ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
        ({"type": ["string", "null"], "minLength": 2}, '"ab"', '"a"'),
    ],
    "maxLength": [({"type": "string", "maxLength": 2}, '"ab"', '"abc"')],
    "pattern": [({"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"')],
}
FORMAT_CASES = {
    "date": ('"2024-01-31"', '"2024-13-01"'),
    "time": ('"12:30:00Z"', '"25:00:00Z"'),
    "date-time": ('"2024-01-31T12:30:00Z"', '"2024-01-31"'),
    "duration": ('"P1D"', '"1D"'),
    "email": ('"a@b.co"', '"ab.co"'),
    "hostname": ('"a.example"', '"a_b"'),
    "ipv4": ('"1.2.3.4"', '"1.2.3.400"'),
    "ipv6": ('"::1"', '"1.2.3.4"'),
    "uuid": ('"12345678-1234-1234-1234-123456789abc"', '"123"'),
    "uri": ('"https://a.b/c"', '"not a uri"'),
    "uri-reference": ('"/a/b"', '"a b"'),
    "uri-template": ('"/a/{b}"', '"/a/{"'),
    "json-pointer": ('"/a/b"', '"a"'),
    "relative-json-pointer": ('"0/a"', '"/a"'),
}
ENFORCED["format"] = [
    ({"type": "string", "format": name}, ok, bad) for name, (ok, bad) in FORMAT_CASES.items()
]

# (schema, the keyword the edge names, an instance xgrammar and JSON Schema disagree on: mostly
# a violating one the grammar lets through; for patternProperties and propertyNames a valid
# one it refuses, since strict mode drops the keyword and then allows no other key).
REFUSED = [
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "array", "items": INT, "contains": {"const": 1}}, "contains", "[2]"),
    ({"type": "object", "patternProperties": {"^x": INT}}, "patternProperties", '{"x1":1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames", '{"ab":1}'),
    ({"type": "integer", "not": {"const": 1}}, "not", "1"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "if", "9"),
    (
        {"type": "object", "properties": {"a": STR, "b": STR}, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        '{"a":"x"}',
    ),
    ({"oneOf": [INT, {"type": "number"}]}, "oneOf", "1"),
    ({"allOf": [INT, {"minimum": 3}]}, "allOf", '"x"'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "1.25"),
    ({"minimum": 3}, "minimum", "2"),
    ({"minLength": 2}, "minLength", '"a"'),
    ({"minItems": 2}, "minItems", "[1]"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength", '"a"'),
    ({"type": "string", "format": "email", "minLength": 10}, "minLength", '"a@b.co"'),
    ({"type": "string", "format": "date", "pattern": "^2"}, "format", '"1999-01-01"'),
    ({"type": "string", "format": "regex"}, "format", '"("'),
    ({"type": "object", "properties": {"a": STR}, "required": ["a", "b"]}, "required", '{"a":"x"}'),
    ({"type": "object", "required": ["b"]}, "required", "{}"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, "maxLength", '"bb"'),
    ({"type": "string", "enum": ["a", 1]}, "type", "1"),
    ({"type": "integer", "const": "x"}, "type", '"x"'),
    (
        {
            "type": "object",
            "properties": {"a": STR},
            "required": ["a"],
            "anyOf": [{"type": "object"}],
        },
        "properties",
        "{}",
    ),
    (
        {"$defs": DEFS, "type": "object", "properties": {"a": {"$ref": "#/$defs/A", "minimum": 5}}},
        "minimum",
        '{"a":1}',
    ),
]


@cache
def _compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


def grammar_accepts(schema: dict, instance: str) -> bool:
    """Whether the grammar the engine would build (strict mode) lets `instance` through whole."""
    compiled = _compiler().compile_json_schema(canonical_json(schema), strict_mode=True)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(instance) and matcher.is_terminated()


def test_every_supported_keyword_has_a_proof():
    assert set(ENFORCED) == SUPPORTED - ANNOTATIONS
    assert set(FORMAT_CASES) == FORMATS
    assert set(ENFORCED) >= DEFINITIONS


CASES = [
    pytest.param(schema, ok, bad, id=f"{keyword}-{i}")
    for keyword, cases in ENFORCED.items()
    for i, (schema, ok, bad) in enumerate(cases)
]


@pytest.mark.parametrize(("schema", "conforming", "violating"), CASES)
def test_supported_keyword_is_enforced_by_xgrammar(schema, conforming, violating):
    assert check_schema(schema) == canonical_json(schema)
    checker = Draft202012Validator.FORMAT_CHECKER
    validator = Draft202012Validator(schema, format_checker=checker)
    assert validator.is_valid(json.loads(conforming))
    if schema.get("format", "date") in checker.checkers:  # some need optional packages
        assert not validator.is_valid(json.loads(violating))
    assert grammar_accepts(schema, conforming)
    assert not grammar_accepts(schema, violating)


@pytest.mark.parametrize(("schema", "keyword", "instance"), REFUSED, ids=[c[1] for c in REFUSED])
def test_refused_keyword_is_not_enforced_by_xgrammar(schema, keyword, instance):
    with pytest.raises(SchemaRefused) as refused:
        check_schema(schema)
    assert refused.value.keyword == keyword
    assert f"'{keyword}'" in refused.value.message
    checker = Draft202012Validator.FORMAT_CHECKER
    is_valid = Draft202012Validator(schema, format_checker=checker).is_valid(json.loads(instance))
    with contextlib.suppress(RuntimeError):  # no grammar at all: nothing enforces it either
        assert grammar_accepts(schema, instance) != is_valid, "xgrammar enforces it now"


def test_annotations_compile_and_constrain_nothing():
    schema = {key: "x" for key in ANNOTATIONS - {"deprecated", "readOnly", "writeOnly"}}
    schema |= {"$schema": "https://json-schema.org/draft/2020-12/schema", "examples": [1]}
    schema |= {"deprecated": True, "readOnly": False, "writeOnly": False, "type": "integer"}
    check_schema(schema)
    assert grammar_accepts(schema, "7")
