"""The JSON schemas of the structured-output runs (tests/integration/test_structured_http.py and
benchmarks/structured.py), each with what to ask for. Every schema is bounded (short enums,
small integer ranges, maxLength, fixed-length patterns, maxItems), so a conforming output ends
well inside a few hundred tokens."""

from __future__ import annotations

OBJ = {"type": "object", "additionalProperties": False}

# (name, what to ask for, schema): nesting, bounded arrays, enums, required and optional
# properties, integer and number ranges, anyOf, patterns, $ref, tuples, multipleOf, formats.
SCHEMAS: list[tuple[str, str, dict]] = [
    (
        "person_nested",
        "Describe a person and their home town in JSON.",
        {
            **OBJ,
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "home": {
                    **OBJ,
                    "properties": {
                        "city": {"type": "string", "maxLength": 16},
                        "coastal": {"type": "boolean"},
                    },
                    "required": ["city", "coastal"],
                },
            },
            "required": ["name", "age", "home"],
        },
    ),
    (
        "digits_bounded_array",
        "List a few small digits as a JSON array.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 4,
        },
    ),
    (
        "colour_enum",
        "Pick a colour for the sky and say how bright it is, in JSON.",
        {
            **OBJ,
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "brightness": {"enum": ["dim", "bright"]},
            },
            "required": ["colour", "brightness"],
        },
    ),
    (
        "optional_properties",
        "Give a product in JSON with an id and, if you like, a short note and a flag.",
        {
            **OBJ,
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "note": {"type": "string", "maxLength": 20},
                "in_stock": {"type": "boolean"},
            },
            "required": ["id"],
        },
    ),
    (
        "number_ranges",
        "Give a temperature reading in JSON: a level and a ratio.",
        {
            **OBJ,
            "properties": {
                "level": {"type": "integer", "minimum": -5, "maximum": 5},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "limit": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
            },
            "required": ["level", "ratio", "limit"],
        },
    ),
    (
        "any_of_value",
        "Answer in JSON with a value that is either a small number or a word.",
        {
            **OBJ,
            "properties": {
                "value": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 50},
                        {"enum": ["none", "many"]},
                        {"type": "boolean"},
                    ]
                }
            },
            "required": ["value"],
        },
    ),
    (
        "code_pattern",
        "Invent a flight code and a gate in JSON.",
        {
            **OBJ,
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                "gate": {"type": "string", "pattern": "^[A-F]-[1-9]$"},
            },
            "required": ["code", "gate"],
        },
    ),
    (
        "ref_points",
        "Give the start and end points of a line in JSON.",
        {
            **OBJ,
            "$defs": {
                "point": {
                    **OBJ,
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["x", "y"],
                }
            },
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
        },
    ),
    (
        "tuple_prefix_items",
        "Answer with a JSON array: yes or no, then a letter.",
        {
            "type": "array",
            "prefixItems": [{"type": "boolean"}, {"enum": ["a", "b", "c"]}],
            "items": False,
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "array_of_objects",
        "List up to three tasks with a priority each, as JSON.",
        {
            **OBJ,
            "properties": {
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        **OBJ,
                        "properties": {
                            "title": {"type": "string", "minLength": 1, "maxLength": 10},
                            "priority": {"enum": ["low", "high"]},
                        },
                        "required": ["title", "priority"],
                    },
                }
            },
            "required": ["tasks"],
        },
    ),
    (
        "multiple_of_and_const",
        "Give a version record in JSON with a step count.",
        {
            **OBJ,
            "properties": {
                "kind": {"const": "version"},
                "steps": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
                "released": {"type": "string", "format": "date"},
            },
            "required": ["kind", "steps", "released"],
        },
    ),
]
