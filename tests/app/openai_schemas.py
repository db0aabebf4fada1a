"""Validate responses against OpenAI's own schemas (a vendored subset of openapi.yaml).

openai_schemas.json holds the response schemas the tests check and everything they $ref,
from github.com/openai/openai-openapi (MIT; provenance inside the file). Regenerate with
    python tests/app/openai_schemas.py /path/to/openapi.yaml
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

VENDORED = Path(__file__).with_name("openai_schemas.json")
ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "ErrorResponse",
    "Response",
    "ResponseItemList",
    "ResponseStreamEvent",
    "TokenCountsResource",
)
_BASE_URI = "urn:openai-openapi"


def _openapi30_nullable(node: Any) -> Any:
    """`nullable: true` (OpenAPI 3.0) -> anyOf [..., null] (JSON Schema)."""
    if isinstance(node, list):
        return [_openapi30_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _openapi30_nullable(value) for key, value in node.items()}
    if converted.pop("nullable", False) is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


@cache
def _registry() -> tuple[Registry, dict[str, Any]]:
    document = json.loads(VENDORED.read_text())
    spec = {"components": {"schemas": _openapi30_nullable(document["schemas"])}}
    resource = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource(_BASE_URI, resource), spec


def validator(name: str) -> Draft202012Validator:
    registry, _ = _registry()
    schema = {"$ref": f"{_BASE_URI}#/components/schemas/{name}"}
    return Draft202012Validator(schema, registry=registry)


def assert_valid(name: str, instance: Any) -> None:
    """Raise jsonschema.ValidationError (with the path) if `instance` breaks schema `name`."""
    validator(name).validate(instance)


# -- regeneration ---------------------------------------------------------------------------


def _refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value.rsplit("/", 1)[-1]
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _strip_docs(node: Any) -> Any:
    if isinstance(node, list):
        return [_strip_docs(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {
        key: _strip_docs(value)
        for key, value in node.items()
        if key != "x-oaiMeta" and not (key in ("description", "example") and isinstance(value, str))
    }


def extract(spec: dict[str, Any]) -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    picked: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in picked:
            picked[name] = _strip_docs(schemas[name])
            todo.extend(_refs(schemas[name]))
    return dict(sorted(picked.items()))


if __name__ == "__main__":
    import yaml

    source = Path(sys.argv[1])
    spec = yaml.load(source.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    document = {
        "provenance": (
            "Subset of openapi.yaml from github.com/openai/openai-openapi "
            "(commit f85dbe223d40e1a31cba812ab2d755c7e98a92a3, spec version "
            f"{spec['info']['version']}); descriptions removed."
        ),
        "license": source.with_name("LICENSE").read_text(),
        "schemas": extract(spec),
    }
    VENDORED.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
