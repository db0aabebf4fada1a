"""Schema fuzzing of a running kvshare server with schemathesis (tests/integration/test_fuzz.py
and tests/integration/long_fuzz.py).

Cases come from two documents: the server's own /openapi.json (every operation), and OpenAI's
openapi.yaml (chat and completions only; what it allows that kvshare lacks must be a 400 naming
the field). Each case is sent once, from a fixed number per operation and generation mode
(positive: valid by the document; negative: broken on purpose), until a time cap. Checks:
- no 5xx;
- every 4xx is OpenAI's error envelope (Anthropic's on /v1/messages); a 400 names a field
  (`param`, or the message on Anthropic's routes) the request has or the API defines, unless
  the body was no JSON object at all;
- every 2xx validates against OpenAI's response schema (JSON, or each SSE chunk), or on
  /v1/messages against the anthropic SDK's own types;
- for the app's own document also schemathesis' conformance checks: the status is declared,
  the content type and the body match the document, and broken input is refused.
Afterwards (check_after): /health answers and /metrics shows nothing running or held, 0 leaked.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import schemathesis
import yaml
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from hypothesis import HealthCheck, Phase
from pydantic import TypeAdapter, ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.app.openai_schemas import validator
from tests.integration.server import scrape

# OpenAI's chat and completions operations and every schema they $ref, vendored from
# github.com/openai/openai-openapi (MIT; provenance inside the file). Regenerate with
#     python -m tests.integration.fuzzing /path/to/openapi.yaml
OPENAI_SUBSET = Path(__file__).with_name("openai_fuzz_subset.json")
OPENAI_PATHS = ("/chat/completions", "/completions")
# A fuzzing server: small caps keep the valid cases cheap on a CPU (they really generate).
SERVER_FLAGS = (
    *("--max-n", "2", "--max-output-tokens", "4", "--default-max-tokens", "2"),
    *("--max-prompts", "2", "--max-messages", "8", "--max-tools", "4"),
    *("--max-model-len", "512", "--grammar-compile-timeout-seconds", "2"),
)
# The app path of a response -> OpenAI's schema for its JSON body, and for its SSE chunks.
RESPONSE_SCHEMAS = {
    "/v1/chat/completions": ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"),
    "/v1/completions": ("CreateCompletionResponse", "CreateCompletionResponse"),
    "/v1/models": ("ListModelsResponse", None),
    "/v1/models/{model}": ("Model", None),
    "/v1/responses/{response_id}": ("Response", None),
    "/v1/responses/{response_id}/input_items": ("ResponseItemList", None),
}
# Anthropic's paths -> the SDK's type of a JSON body, and of each SSE event.
ANTHROPIC_TYPES: dict[str, tuple[Any, Any]] = {
    "/v1/messages": (Message, RawMessageStreamEvent),
    "/v1/messages/count_tokens": (MessageTokensCount, None),
}
ANTHROPIC_PREFIX = "/v1/messages"
APP_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
_BODY_CODES = ("invalid_json", "invalid_body")  # 400s about the body as a whole
_RESERVE_SECONDS = 2.0  # kept back per later (operation, mode) of a run
_MAX_FINDINGS = 8  # distinct findings kept per operation


@dataclass
class OperationReport:
    """What was sent to one operation of one document, and what was found."""

    label: str
    num_requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # 4xx by the field they name
    findings: list[str] = field(default_factory=list)
    num_findings: int = 0

    def add_finding(self, text: str) -> None:
        self.num_findings += 1
        if text not in self.findings and len(self.findings) < _MAX_FINDINGS:
            self.findings.append(text)


def app_document(base_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def openai_document() -> schemathesis.BaseSchema:
    """OpenAI's chat and completions operations (and every schema they refer to)."""
    subset = json.loads(OPENAI_SUBSET.read_text())
    subset.pop("x-provenance", None)
    return schemathesis.openapi.from_dict(subset)


def extract_openai_subset(spec_path: Path) -> dict[str, Any]:
    """The chat and completions operations of OpenAI's openapi.yaml, with what they refer to."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec = yaml.load(spec_path.read_text(), Loader=loader)
    paths = {path: {"post": spec["paths"][path]["post"]} for path in OPENAI_PATHS}
    components: dict[str, dict[str, Any]] = {}
    todo = list(_refs(paths))
    while todo:
        section, name = todo.pop()
        picked = components.setdefault(section, {})
        if name not in picked:
            picked[name] = spec["components"][section][name]
            todo.extend(_refs(picked[name]))
    return {
        "x-provenance": "Subset of openapi.yaml from github.com/openai/openai-openapi "
        f"(MIT License, Copyright OpenAI), info.version {spec['info'].get('version')}: "
        "the chat and completions operations and every component they refer to.",
        "openapi": spec["openapi"],
        "info": spec["info"],
        "paths": paths,
        "components": components,
    }


def _refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):  # "#/components/<section>/<name>"
                section, name = value.split("/")[-2:]
                yield section, name
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@dataclass
class Fuzzer:
    """Sends the cases of one document to `base_url` and checks each answer."""

    base_url: str
    model: str
    kind: str  # "app" (the server's own document) or "openai"
    known_fields: frozenset[str]  # top-level request fields the API defines
    reports: dict[str, OperationReport] = field(default_factory=dict)

    @property
    def call_url(self) -> str:
        return self.base_url if self.kind == "app" else f"{self.base_url}/v1"

    def run(self, document: schemathesis.BaseSchema, examples: int, seconds: float, seed: int):
        """`examples` cases per operation and mode, in `seconds` at most: each (operation,
        mode) may use the time left but a reserve for each one after it (a few seconds:
        most operations answer in milliseconds), so a slow one starves no other."""
        end = time.monotonic() + seconds
        operations = [result.ok() for result in document.get_all_operations()]
        slots = [
            (operation, mode)
            for operation in operations
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        ]
        reserve = min(_RESERVE_SECONDS, seconds / (2 * len(slots)))
        for number, (operation, mode) in enumerate(slots):
            deadline = end - reserve * (len(slots) - number - 1)
            label = f"{self.kind} {operation.method.upper()} {operation.path}"
            report = self.reports.setdefault(label, OperationReport(label))
            self._fuzz(operation, mode, examples, deadline, seed, report)
        return list(self.reports.values())

    def _fuzz(self, operation, mode, examples, deadline, seed, report) -> None:
        @hypothesis.seed(seed)
        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # each case once: no shrinking, no replay
            suppress_health_check=list(HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def send(case) -> None:
            if time.monotonic() < deadline:
                self._send(case, mode, report)

        try:
            send()
        except hypothesis.errors.Unsatisfiable:
            pass  # an operation without parameters or body has nothing to break
        except hypothesis.errors.HypothesisException as e:
            report.add_finding(f"generation ({mode.value}): {type(e).__name__}: {e}")

    def _send(self, case, mode: GenerationMode, report: OperationReport) -> None:
        # Most valid cases name the served model (a random name only gets its 404).
        if mode is GenerationMode.POSITIVE and report.num_requests % 4 != 3:
            if isinstance(case.body, dict):
                case.body["model"] = self.model
            if case.path_parameters and "model" in case.path_parameters:
                case.path_parameters["model"] = self.model
            if case.path_parameters and "response_id" in case.path_parameters:
                case.path_parameters["response_id"] = self._stored_response_id()
        try:
            response = case.call(base_url=self.call_url, timeout=120)
        except Exception as e:  # the server dropped the connection: as bad as a 5xx
            report.num_requests += 1
            report.add_finding(f"no response ({type(e).__name__}: {e}) to {_show(case.body)}")
            return
        report.num_requests += 1
        report.statuses[response.status_code] += 1
        if 400 <= response.status_code < 500:
            report.refused[_refused_field(response)] += 1
        for problem in self._problems(case, response):
            report.add_finding(f"{response.status_code}: {problem} <- {_show(case.body)}")

    def _stored_response_id(self) -> str:
        """A new stored response's id (a DELETE case may remove the one before)."""
        body = {"model": self.model, "input": "Hi"}
        response = httpx.post(f"{self.base_url}/v1/responses", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["id"]

    def _problems(self, case, response) -> list[str]:
        status = response.status_code
        problems = []
        if status >= 500:
            problems.append("server error: " + response.content[:300].decode(errors="replace"))
        elif status >= 400:
            sent = {**(case.query or {}), **(case.body if isinstance(case.body, dict) else {})}
            if case.operation.path.startswith(ANTHROPIC_PREFIX):
                problems += _anthropic_envelope_problems(sent, response, self.known_fields)
            else:
                problems += _envelope_problems(sent, response, self.known_fields)
        elif 200 <= status < 300:
            path = case.operation.path
            app_path = path if self.kind == "app" else "/v1" + path
            if case.operation.method.lower() != "delete":  # the schemas are GETs' and POSTs'
                problems += response_problems(app_path, response)
        if self.kind == "app":
            try:
                case.validate_response(response, checks=APP_CHECKS)
            except Exception as e:  # schemathesis raises a FailureGroup (an ExceptionGroup)
                problems.append(f"conformance: {str(e).strip()[:400]}")
        return problems


def _envelope_problems(sent: dict[str, Any], response, known_fields: frozenset[str]) -> list[str]:
    """`sent`: the body's fields and the query's parameters."""
    try:
        payload = json.loads(response.content)
    except ValueError:
        return ["4xx body is not JSON"]
    errors = [e.message for e in validator("ErrorResponse").iter_errors(payload)]
    if errors or not isinstance(payload.get("error"), dict):
        return [f"4xx body is not the error envelope: {errors[:2]}"]
    error = payload["error"]
    if response.status_code != 400 or error.get("code") in _BODY_CODES:
        return []
    param = error.get("param")
    if not param:
        return [f"400 names no field: {error.get('message')!r}"]
    root = param.split(".")[0].split("[")[0]
    if root not in sent and root not in known_fields:
        return [f"400 names {param!r}, which is no field of the request"]
    return []


def _anthropic_envelope_problems(
    sent: dict[str, Any], response, known_fields: frozenset[str]
) -> list[str]:
    """Anthropic's envelope; a 400's message names a field the request has or defines."""
    try:
        payload = json.loads(response.content)
        kind, message = payload["error"]["type"], payload["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ["4xx body is not Anthropic's error envelope"]
    if payload.get("type") != "error" or not isinstance(kind, str) or not message:
        return [f"4xx body is not Anthropic's error envelope: {payload}"]
    if response.status_code != 400 or message.startswith("The request body"):
        return []
    if not any(name in message for name in (*sent, *known_fields)):
        return [f"400 names no field: {message!r}"]
    return []


def _anthropic_problems(app_path: str, response) -> list[str]:
    """A 2xx body of Anthropic's routes against the SDK's types (each SSE event)."""
    final, event = ANTHROPIC_TYPES.get(app_path, (None, None))
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if content_type.startswith("text/event-stream"):
        items = [json.loads(data) for data in _sse_payloads(response.content.decode())]
        kind = TypeAdapter(event)
        items = [item for item in items if item.get("type") not in ("ping", "error")]
        if not items or items[-1].get("type") != "message_stop":
            return ["event stream does not end with message_stop"]
    else:
        items, kind = [json.loads(response.content)], TypeAdapter(final)
    problems = []
    for item in items:
        try:
            kind.validate_python(item)
        except ValidationError as e:
            problems.append(f"breaks the SDK's {kind}: {str(e)[:200]}")
    return problems[:3]


def response_problems(app_path: str, response) -> list[str]:
    """A 2xx body against OpenAI's schema for it (each chunk when it is an event stream)."""
    if app_path.startswith(ANTHROPIC_PREFIX):
        return _anthropic_problems(app_path, response)
    final, chunk = RESPONSE_SCHEMAS.get(app_path, (None, None))
    if final is None:
        return []
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if content_type.startswith("text/event-stream"):
        payloads = _sse_payloads(response.content.decode())
        if not payloads or payloads[-1] != "[DONE]":
            return ["event stream does not end with [DONE]"]
        chunks = [_as_final(app_path, json.loads(data)) for data in payloads[:-1]]
        return [
            f"chunk breaks {chunk}: {error.message}"
            for data in chunks
            for error in validator(chunk).iter_errors(data)
        ][:3]
    return [
        f"body breaks {final}: {e.message}"
        for e in validator(final).iter_errors(json.loads(response.content))
    ][:3]


def _as_final(app_path: str, chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed completions chunk as the final response it is checked against. OpenAI's
    spec has no chunk schema for completions, and OpenAI (like vLLM) streams them with
    `finish_reason: null` until a choice ends: that null alone is let through."""
    if app_path != "/v1/completions":
        return chunk
    choices = [
        {**choice, "finish_reason": choice.get("finish_reason") or "stop"}
        for choice in chunk.get("choices", [])
    ]
    return {**chunk, "choices": choices}


def _sse_payloads(text: str) -> list[str]:
    payloads = []
    for event in text.split("\n\n"):
        lines = [line[len("data: ") :] for line in event.split("\n") if line.startswith("data: ")]
        if lines:
            payloads.append("\n".join(lines))
    return payloads


def _refused_field(response) -> str:
    try:
        error = json.loads(response.content)["error"]
        return f"{response.status_code} {error.get('param') or error.get('code')}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} ?"


def _show(body: Any) -> str:
    text = (
        body.decode(errors="replace") if isinstance(body, bytes) else json.dumps(body, default=str)
    )
    return text if len(text) <= 300 else text[:300] + "..."


def request_fields(base_url: str) -> frozenset[str]:
    """Every top-level field the app's request bodies define (a 400 may name a missing one)."""
    doc = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    names = set()
    for operations in doc["paths"].values():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {})
            ref = content.get("application/json", {}).get("schema", {}).get("$ref")
            if ref is not None:
                names |= set(schemas[ref.rsplit("/", 1)[-1]].get("properties", {}))
    return frozenset(names)


def check_after(base_url: str, settle_s: float = 30.0) -> list[str]:
    """The server is alive and holds nothing: no request running or waiting, no private or
    shared block, nothing leaked. Aborts may take an engine step to land, hence the wait."""
    if httpx.get(f"{base_url}/health", timeout=10).status_code != 200:
        return ["/health does not answer 200"]
    wanted = {
        'kvshare_requests{state="running"}': 0,
        'kvshare_requests{state="waiting"}': 0,
        'kvshare_kv_blocks{state="private"}': 0,
        'kvshare_kv_blocks{state="shared"}': 0,
        "kvshare_kv_blocks_leaked": 0,
    }
    deadline = time.monotonic() + settle_s
    while True:
        metrics = scrape(base_url)
        wrong = {name: metrics.get(name) for name in wanted if metrics.get(name) != 0}
        if not wrong or time.monotonic() > deadline:
            return [f"{name} is {value}" for name, value in wrong.items()]
        time.sleep(0.5)


def summary(reports: list[OperationReport]) -> str:
    """One line per operation: requests sent, statuses, findings."""
    lines = []
    for report in reports:
        statuses = " ".join(f"{s}x{n}" for s, n in sorted(report.statuses.items()))
        lines.append(
            f"{report.label}: {report.num_requests} requests ({statuses}), "
            f"{report.num_findings} findings"
        )
        lines += [f"    {finding}" for finding in report.findings]
    return "\n".join(lines)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    OPENAI_SUBSET.write_text(json.dumps(extract_openai_subset(source), indent=1) + "\n")
