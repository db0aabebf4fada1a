"""Engine error types -> HTTP statuses through app/errors.py's one table, and the HTTP edge
validating each EngineRequest exactly once (engine/core/validation.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from fake_engine import FakeEngine
from helpers import chat_body, open_client, sse_data

from app.errors import api_error
from app.settings import ServerSettings, Settings
from engine.core.config import EngineConfig
from engine.core.errors import (
    DuplicateRequest,
    EngineNotReady,
    FaultInjectionDisabled,
    InvalidFaultTarget,
    KVShareError,
    ParamError,
    UnknownFaultKind,
)
from engine.core.protocol import AdmittedRequest, FaultReport, RequestOutput
from engine.tokenizer import ChatTemplateError

pytestmark = pytest.mark.anyio

INVALID = "invalid_request_error"
# error, status, type, param, code, message
MAPPED = [
    (ParamError("top_p", "top_p is bad"), 400, INVALID, "top_p", None, None),
    (
        DuplicateRequest("r1"),
        400,
        INVALID,
        "request_id",
        None,
        "request id 'r1' is already running",
    ),
    (
        UnknownFaultKind("flip", ("corrupt_block", "wrong_block")),
        400,
        INVALID,
        "kind",
        None,
        "unknown fault kind 'flip'; use one of corrupt_block, wrong_block",
    ),
    (
        ChatTemplateError("bad role tool"),
        400,
        INVALID,
        "messages",
        None,
        "The chat template rejected the messages: bad role tool",
    ),
    (FaultInjectionDisabled("off"), 403, INVALID, None, "fault_injection_disabled", "off"),
    (InvalidFaultTarget("block 9"), 409, INVALID, None, "no_fault_target", "block 9"),
    (EngineNotReady("not running"), 503, "server_error", None, "not_ready", "not running"),
    (
        KVShareError("unlisted"),
        500,
        "server_error",
        None,
        "engine_error",
        "The engine failed this request: unlisted",
    ),
]


@pytest.mark.parametrize(("error", "status", "type_", "param", "code", "message"), MAPPED)
def test_each_engine_error_type_has_its_status(error, status, type_, param, code, message) -> None:
    api = api_error(error)
    assert (api.status_code, api.type, api.param, api.code) == (status, type_, param, code)
    assert api.message == (message or error.message)


class RefusingEngine(FakeEngine):
    """A FakeEngine whose generate() and inject_fault() raise `self.error`."""

    error: Exception = KVShareError("unset")

    def generate(self, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(admitted.request)
        return self._refuse()

    async def _refuse(self) -> AsyncIterator[RequestOutput]:
        raise self.error
        yield  # an async generator, like AsyncEngine.generate: it raises when iterated

    async def inject_fault(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        raise self.error


@pytest.mark.parametrize(("error", "status", "type_", "param", "code", "message"), MAPPED)
async def test_an_error_the_engine_raises_reaches_the_client_mapped(
    tokenizer_dir, error, status, type_, param, code, message
) -> None:
    engine = RefusingEngine(tokenizer_dir)
    engine.error = error
    async with open_client(engine) as client:
        response = await client.post("/v1/chat/completions", json=chat_body())
        streamed = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == status, response.text
    expected = {"message": api_error(error).message, "type": type_, "param": param, "code": code}
    assert response.json() == {"error": expected}
    assert streamed.status_code == 200  # the stream had begun: the error is its last event
    *_, last_event, done = sse_data(streamed.text)
    assert (json.loads(last_event), done) == (response.json(), "[DONE]")


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidFaultTarget("block 99 is not in the prefix cache"), 409, "no_fault_target"),
        (EngineNotReady("the engine is not running"), 503, "not_ready"),
        (FaultInjectionDisabled("fault injection is disabled"), 403, "fault_injection_disabled"),
    ],
)
async def test_fault_drill_refusals_are_mapped_by_the_table(
    tokenizer_dir, error, status, code
) -> None:
    engine = RefusingEngine(tokenizer_dir)
    engine.error = error
    settings = Settings(server=ServerSettings(), engine=EngineConfig(enable_fault_injection=True))
    async with open_client(engine, settings) as client:
        response = await client.post("/debug/faults", json={"kind": "corrupt_block"})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"] == str(error)


async def test_the_engine_admits_each_engine_request_once_and_runs_what_it_admitted(
    client, engine
) -> None:
    chat = await client.post("/v1/chat/completions", json=chat_body())
    completions = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": ["a", "b"]}
    )
    assert (chat.status_code, completions.status_code) == (200, 200)
    ids = [request.request_id for request in engine.requests]
    assert engine.admissions == [(ids[0], "messages"), (ids[1], "prompt"), (ids[2], "prompt")]


async def test_a_prompt_the_engine_refuses_at_admission_is_a_400_before_any_stream(
    client, engine
) -> None:
    vocab_size = engine.model_info.vocab_size
    body = {"model": "fake-model", "prompt": [1, vocab_size], "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert engine.requests == []  # nothing ran
