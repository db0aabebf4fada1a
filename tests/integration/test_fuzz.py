"""Schema fuzzing against a real `kvshare serve` (SmolLM2), bounded for CI.

Cases from the server's own /openapi.json (every operation) and from OpenAI's openapi.yaml
(chat and completions), a fixed number per operation and generation mode with a fixed seed,
under a time cap (tests/integration/fuzzing.py says what is checked). A longer, randomly
seeded run: tests/integration/long_fuzz.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from tests.integration.fuzzing import (
    SERVER_FLAGS,
    Fuzzer,
    app_document,
    check_after,
    openai_document,
    request_fields,
    response_problems,
    summary,
)
from tests.integration.server import running_server

pytestmark = pytest.mark.integration

SEED = 15
APP_EXAMPLES, APP_SECONDS = 12, 90.0  # per operation and mode; for the whole document
OPENAI_EXAMPLES, OPENAI_SECONDS = 10, 50.0


@pytest.fixture(scope="module")
def fuzz_url() -> Iterator[str]:
    with running_server(*SERVER_FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def model(fuzz_url: str) -> str:
    return httpx.get(f"{fuzz_url}/v1/models", timeout=30).json()["data"][0]["id"]


def _fuzz(url: str, model: str, kind: str, examples: int, seconds: float) -> None:
    fuzzer = Fuzzer(url, model, kind, request_fields(url))
    document = app_document(url) if kind == "app" else openai_document()
    reports = fuzzer.run(document, examples, seconds, SEED)
    print(summary(reports))  # the record: requests per operation, statuses, findings
    assert all(report.num_requests > 0 for report in reports), summary(reports)
    assert sum(report.num_findings for report in reports) == 0, summary(reports)
    assert check_after(url) == []


def test_the_app_document(fuzz_url: str, model: str) -> None:
    _fuzz(fuzz_url, model, "app", APP_EXAMPLES, APP_SECONDS)


def test_the_openai_document(fuzz_url: str, model: str) -> None:
    _fuzz(fuzz_url, model, "openai", OPENAI_EXAMPLES, OPENAI_SECONDS)


def _response(content: bytes, content_type: str) -> SimpleNamespace:
    return SimpleNamespace(content=content, headers={"content-type": [content_type]})


def test_the_response_checks_accept_real_answers_and_catch_broken_ones(fuzz_url, model) -> None:
    """The oracle itself: real answers pass OpenAI's schemas, a damaged one does not."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with httpx.Client(base_url=fuzz_url, timeout=60) as http:
        final = http.post("/v1/chat/completions", json=body)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    path = "/v1/chat/completions"
    assert response_problems(path, _response(final.content, "application/json")) == []
    assert response_problems(path, _response(streamed.content, "text/event-stream")) == []
    broken = json.loads(final.content)
    del broken["choices"][0]["finish_reason"]
    damaged = _response(json.dumps(broken).encode(), "application/json")
    assert response_problems(path, damaged) != []
    unfinished = streamed.content.replace(b"data: [DONE]", b"")
    assert response_problems(path, _response(unfinished, "text/event-stream")) != []
