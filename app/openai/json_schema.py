"""Which JSON Schemas kvshare enforces, checked at the edge (torch-free).

The engine turns a response_format schema into a grammar with xgrammar (compile_json_schema,
strict_mode=True). xgrammar enforces a subset of JSON Schema and silently ignores the rest, so
a schema is refused here, with a 400 naming the keyword and where it is, unless every keyword
in it is one the grammar really enforces, in a combination it enforces. The tables below are
that subset; tests/app/test_json_schema_keywords.py proves each entry against xgrammar.

What the probes found (xgrammar 0.2.9), and why the rules below exist:
- A schema object is compiled by its first keyword in the order $ref, const, enum, anyOf,
  oneOf, allOf, type; the others beside it are dropped. So those keywords stand alone.
- Type keywords (minLength, minimum, items, ...) apply only when the schema's `type` names
  their type (properties / additionalProperties / items also imply it); alone they are dropped.
- Of a string's pattern, format and minLength/maxLength only one kind is enforced.
- `required` names outside `properties` are dropped; multipleOf is enforced on integers only;
  oneOf falls back to anyOf; allOf with more than one schema becomes "anything".
- `pattern` must match the whole string (stricter than JSON Schema's search; output conforms).
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError as JSONSchemaError

from engine.core.config import MAX_SCHEMA_BYTES_CEILING
from engine.core.errors import ParamError

# Canonical JSON text, in bytes: the most any max_schema_bytes setting may allow. The served
# routes check the configured cap first (app/serving/limits.py, a 400 naming
# max_schema_bytes); this is the backstop for any caller of check_schema that does not.
MAX_SCHEMA_BYTES = MAX_SCHEMA_BYTES_CEILING
MAX_SCHEMA_DEPTH = 32  # nesting of JSON containers; keeps every walk of the schema shallow
PARAM = "response_format"
WHERE = "response_format.json_schema.schema"

# Keywords that say nothing about which instances are valid: accepted anywhere.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "deprecated"}
    | {"readOnly", "writeOnly"}
)
# Containers of named subschemas, reachable with $ref (definitions: draft-07 / pydantic v1).
DEFINITIONS = frozenset({"$defs", "definitions"})
# Keywords that must stand alone (besides annotations and definitions): xgrammar compiles the
# first of these it finds and drops every sibling. `type` may go beside enum/const when every
# listed value already has that type (then dropping it loses nothing).
ALONE = ("$ref", "const", "enum", "anyOf", "allOf")
# Type keywords, by the type they belong to; enforced only when the schema is of that type.
TYPE_KEYWORDS: dict[str, frozenset[str]] = {
    "object": frozenset(
        {"properties", "required", "additionalProperties", "unevaluatedProperties"}
        | {"minProperties", "maxProperties"}
    ),
    "array": frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "integer": frozenset(
        {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    ),
}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Formats xgrammar turns into a regular expression (others are dropped).
FORMATS = frozenset(
    {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
    | {"uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
)
# At most one of these groups per string schema: xgrammar enforces only one of them.
STRING_GROUPS = ({"pattern"}, {"format"}, {"minLength", "maxLength"})
SUPPORTED = frozenset({"type", *ALONE, *DEFINITIONS}.union(*TYPE_KEYWORDS.values()) | ANNOTATIONS)
# Keywords that imply an object / array schema when `type` is absent (xgrammar's dispatch).
IMPLIES_OBJECT = frozenset({"properties", "additionalProperties", "unevaluatedProperties"})
IMPLIES_ARRAY = frozenset({"items", "prefixItems", "unevaluatedItems"})
_ADVICE = {
    "oneOf": "use anyOf (the grammar cannot check that exactly one branch matches)",
    "uniqueItems": "the grammar cannot compare array items",
    "not": "the grammar cannot negate a schema",
}


class SchemaRefused(ParamError):
    """A response_format schema kvshare would not enforce as written (a 400).

    `keyword` and `pointer` (a JSON pointer into the schema, "" for the root) say where.
    """

    def __init__(self, message: str, keyword: str | None = None, pointer: str = "") -> None:
        super().__init__(PARAM, message)
        self.keyword = keyword
        self.pointer = pointer


def canonical_json(schema: Any) -> str:
    """The one text of a schema: equal schemas give equal strings (the engine compiles it and
    caches by it). Keys are sorted, except the names under each `properties`: their order is
    the order the grammar writes the properties in (the client's, as OpenAI keeps it)."""
    return json.dumps(_canonical(schema), separators=(",", ":"))


def _canonical(value: Any, keep_order: bool = False) -> Any:
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if not isinstance(value, dict):
        return value
    keys = list(value) if keep_order else sorted(value)
    return {key: _canonical(value[key], key == "properties" and not keep_order) for key in keys}


def canonical_text(schema: Any, param: str) -> str | None:
    """canonical_json(schema), None for no schema; a ParamError naming `param` for one nested
    past Python's stack. A request serializes each schema once, with this: the size cap
    (app/serving/limits.py) measures the text, check_schema takes it, the engine compiles it."""
    if schema is None:
        return None
    try:
        return canonical_json(schema)
    except RecursionError:  # nested past Python's stack: far past any depth cap
        raise ParamError(param, f"{param} holds a schema nested too deeply") from None


def check_schema(schema: Any, text: str | None = None) -> str:
    """Raise SchemaRefused unless the grammar enforces all of `schema`; return its canonical
    JSON: `text` when the caller has it (canonical_text(schema)), else computed here. Checks
    run cheapest first: depth, size, JSON Schema validity, then keywords."""
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaRefused(f"{WHERE} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    if text is None:
        text = canonical_json(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        message = f"{WHERE} is {len(text.encode())} bytes of JSON; the limit is {MAX_SCHEMA_BYTES}"
        raise SchemaRefused(message)
    if not isinstance(schema, dict):
        raise SchemaRefused(f"{WHERE} must be a JSON object, got {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except JSONSchemaError as e:
        pointer = "".join(f"/{_escape(part)}" for part in e.path)
        message = f"{WHERE} is not a valid JSON Schema (draft 2020-12): {e.message}"
        raise SchemaRefused(message + f" (at '{pointer or '/'}')", pointer=pointer) from e
    checked: set[str] = set()
    refs: list[tuple[str, str]] = []
    _check_node(schema, "", checked, refs)
    for ref, pointer in refs:
        _check_ref(ref, pointer, checked)
    return text


def _depth(value: Any) -> int:
    """Nesting depth of JSON containers, without recursion (the input may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_SCHEMA_DEPTH:  # deeper is refused anyway
                children = node.values() if isinstance(node, dict) else node
                stack.extend((child, level + 1) for child in children)
    return deepest


def _escape(part: object) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def _refuse(keyword: str, pointer: str, why: str) -> SchemaRefused:
    where = f"'{pointer}'" if pointer else "the root"
    message = f"{WHERE}: keyword '{keyword}' at {where} is not supported: {why}"
    return SchemaRefused(message, keyword=keyword, pointer=f"{pointer}/{_escape(keyword)}")


def _types_of(node: dict[str, Any]) -> set[str]:
    """The types a schema is compiled as: its `type`, else what its keywords imply."""
    declared = node.get("type")
    if declared is not None:
        return {declared} if isinstance(declared, str) else set(declared)
    if IMPLIES_OBJECT & node.keys():
        return {"object"}
    if IMPLIES_ARRAY & node.keys():
        return {"array"}
    return set()


def _check_node(node: Any, pointer: str, checked: set[str], refs: list[tuple[str, str]]) -> None:
    """Check one (valid) schema and, through _subschemas, everything below it; note its
    pointer in `checked` and each $ref in `refs`."""
    checked.add(pointer)
    if isinstance(node, bool):
        return  # true: anything; false: nothing (the engine refuses it as unsatisfiable)
    for keyword in node:
        if keyword not in SUPPORTED:
            raise _refuse(keyword, pointer, _ADVICE.get(keyword, "the grammar would ignore it"))
    _check_alone(node, pointer)
    _check_type_keywords(node, pointer)
    if "$ref" in node:
        refs.append((node["$ref"], pointer))
    for child, child_pointer in _subschemas(node, pointer):
        _check_node(child, child_pointer, checked, refs)


def _check_alone(node: dict[str, Any], pointer: str) -> None:
    alone = [keyword for keyword in ALONE if keyword in node]
    if not alone:
        return
    allowed = ANNOTATIONS | DEFINITIONS | {alone[0]}
    if alone[0] in ("const", "enum") and _values_have_type(node):
        allowed = allowed | {"type"}
    extra = sorted(node.keys() - allowed)
    if extra:
        why = f"it cannot go beside '{alone[0]}', which the grammar would apply alone"
        raise _refuse(extra[0], pointer, why)
    if alone[0] == "allOf" and len(node["allOf"]) != 1:
        raise _refuse("allOf", pointer, "only an allOf of exactly one schema is enforced")


def _values_have_type(node: dict[str, Any]) -> bool:
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or ())
    values = [node["const"]] if "const" in node else node.get("enum", [])
    return bool(types) and all(any(_has_type(value, t) for t in types) for value in values)


def _has_type(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        return is_number and float(value).is_integer()
    python_types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
        "number": int | float,
    }
    return isinstance(value, python_types[type_name]) and (
        type_name == "boolean" or not isinstance(value, bool)
    )


def _check_type_keywords(node: dict[str, Any], pointer: str) -> None:
    types = _types_of(node)
    for keyword in sorted(node.keys() - {"type"}):
        owners = [t for t, keywords in TYPE_KEYWORDS.items() if keyword in keywords]
        if owners and not types & set(owners):
            why = f'it applies only beside "type": "{owners[0]}"'
            raise _refuse(keyword, pointer, why)
    if "multipleOf" in node and "number" in types:
        raise _refuse("multipleOf", pointer, 'it is enforced on "type": "integer" only')
    if "integer" in types:
        for keyword in TYPE_KEYWORDS["integer"] & node.keys():
            if not float(node[keyword]).is_integer():
                raise _refuse(keyword, pointer, "an integer's bound must be a whole number")
    _check_string_keywords(node, pointer)
    _check_required(node, pointer)


def _check_string_keywords(node: dict[str, Any], pointer: str) -> None:
    groups = [group for group in STRING_GROUPS if group & node.keys()]
    if len(groups) > 1:
        first, second = (sorted(group & node.keys())[0] for group in groups[:2])
        raise _refuse(second, pointer, f"the grammar enforces only one of it and '{first}'")
    if "format" in node and node["format"] not in FORMATS:
        why = f"format '{node['format']}' is not enforced; use one of {', '.join(sorted(FORMATS))}"
        raise _refuse("format", pointer, why)


def _check_required(node: dict[str, Any], pointer: str) -> None:
    listed = node.get("properties", {})
    missing = [name for name in node.get("required", ()) if name not in listed]
    if missing:
        why = f"required property '{missing[0]}' must also be listed in 'properties'"
        raise _refuse("required", pointer, why)


def _subschemas(node: dict[str, Any], pointer: str):
    """(subschema, its JSON pointer) for each schema nested in `node`."""
    for keyword in ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems"):
        if keyword in node:
            yield node[keyword], f"{pointer}/{keyword}"
    for keyword in ("prefixItems", "anyOf", "allOf"):
        for index, child in enumerate(node.get(keyword, ())):
            yield child, f"{pointer}/{keyword}/{index}"
    for keyword in ("properties", *DEFINITIONS):
        for name, child in node.get(keyword, {}).items():
            yield child, f"{pointer}/{keyword}/{_escape(name)}"


def _check_ref(ref: str, pointer: str, checked: set[str]) -> None:
    """A $ref must name a schema checked above: '#' or '#/...' into $defs, properties, ...;
    anything else (remote, or into an annotation such as examples) could escape the check."""
    if not ref.startswith("#") or ref[1:] not in checked:
        why = f"'{ref}' must point to a schema inside this one ('#' or '#/$defs/...')"
        raise _refuse("$ref", pointer, why)
