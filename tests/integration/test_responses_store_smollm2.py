"""Stored responses against a real `kvshare serve` of the embedded default (SmolLM2): a chain
over previous_response_id is served from the prefix cache, bad chained input is refused with
nothing leaked, and a stored response survives a kill -9 of the server."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.responses_chain import GOAL, QUESTIONS, run_chain, table
from tests.integration.server import running_process, scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store") / "responses.sqlite3"


@pytest.fixture(scope="module")
def server(store_path: Path) -> Iterator[str]:
    with running_process("--store-path", str(store_path)) as (_, url):
        yield url


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_a_four_turn_chain_is_served_from_the_cache(server: str) -> None:
    """cached_tokens >= 90% of the previous turn's input + output on every later turn (the
    pool is far from full: nothing is evicted). benchmarks/README.md has the figures."""
    figures = run_chain(server, model_of(server), QUESTIONS[:4])
    print(table(figures))
    assert len(figures) == 4 and figures[0].previous_tokens == 0
    for turn in figures[1:]:
        assert turn.cached_tokens >= GOAL * turn.previous_tokens, table(figures)
        assert turn.input_tokens > turn.previous_tokens  # the chain grew by the new question


def test_bad_chained_input_is_refused_and_leaks_nothing(server: str) -> None:
    model = model_of(server)
    with httpx.Client(base_url=server, timeout=120) as http:
        first = http.post(
            "/v1/responses", json={"model": model, "input": "Hi", "max_output_tokens": 16}
        )
        assert first.status_code == 200, first.text
        cases = [
            ({"previous_response_id": "resp_unknown", "input": "Hi"}, 404, "previous_response_id"),
            (
                {
                    "previous_response_id": first.json()["id"],
                    "input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}],
                },
                400,
                "input[0].call_id",
            ),
        ]
        for fields, status, param in cases:
            response = http.post("/v1/responses", json={"model": model, **fields})
            assert response.status_code == status, response.text
            assert response.json()["error"]["param"] == param
        again = http.post(
            "/v1/responses",
            json={
                "model": model,
                "input": "And then?",
                "previous_response_id": first.json()["id"],
                "max_output_tokens": 16,
            },
        )
        assert again.status_code == 200, again.text
    assert scrape(server)["kvshare_kv_blocks_leaked"] == 0


def test_a_stored_response_survives_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    with running_process("--store-path", str(path)) as (process, url):
        model = model_of(url)
        body = {"model": model, "input": "Name a colour.", "max_output_tokens": 16}
        created = httpx.post(f"{url}/v1/responses", json=body, timeout=120).json()
        assert created["store"] is True
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    with running_process("--store-path", str(path)) as (_, url):
        fetched = httpx.get(f"{url}/v1/responses/{created['id']}", timeout=30)
        assert fetched.status_code == 200 and fetched.json() == created
        follow = {**body, "input": "Another one?", "previous_response_id": created["id"]}
        chained = httpx.post(f"{url}/v1/responses", json=follow, timeout=120)
        assert chained.status_code == 200, chained.text
        assert scrape(url)["kvshare_stored_responses"] == 2
