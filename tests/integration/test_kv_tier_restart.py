"""Warm restart through the real product: `kvshare serve` of the embedded default with the disk
tier, stopped gracefully (SIGINT) and started again on the same directory. The first request
after the restart is served from the tier (cached_tokens, the tier metrics) with the same
greedy text, a client that disconnects mid-stream after a tier load leaves no block behind,
and a server started with other settings (another KV dtype: another fingerprint) serves none
of the old entries."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

SYSTEM = (
    "You are the archivist of a small harbour town. You answer questions about the town's "
    "boats, its lighthouse keepers and its weather records in two short sentences, citing the "
    "ledger volume you took the answer from. "
) * 8
QUESTION = "Which keeper lit the lighthouse during the storm of 1911?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def tier_flags(directory) -> list[str]:
    return ["--kv-tier", "disk", "--kv-tier-dir", str(directory), "--num-kv-blocks", "256"]


def ask(base_url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=12
    )
    details = response.usage.prompt_tokens_details
    return response.choices[0].message.content, details.cached_tokens if details else 0


def disconnect_mid_stream(base_url: str) -> None:
    """Stream the request and hang up after its first token (admitted: its blocks loaded)."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=60.0) as http:
        models = http.get(f"{base_url}/v1/models").json()
        body["model"] = models["data"][0]["id"]
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"
                ):
                    break


def wait_no_held_blocks(base_url: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        metrics = scrape(base_url)
        held = (
            metrics['kvshare_kv_blocks{state="private"}']
            + metrics['kvshare_kv_blocks{state="shared"}']
        )
        if held == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_a_graceful_restart_serves_the_first_request_from_the_tier(tmp_path) -> None:
    with running_server(*tier_flags(tmp_path)) as base_url:
        text, cached = ask(base_url)
        assert cached == 0
    assert list(tmp_path.glob("*.kvb"))  # the graceful stop wrote the pool's cached blocks
    with running_server(*tier_flags(tmp_path)) as base_url:
        before = scrape(base_url)
        assert before["kvshare_kv_tier_restored_entries"] > 0
        disconnect_mid_stream(base_url)  # the first request after the restart: loads, hangs up
        metrics = wait_no_held_blocks(base_url)
        assert metrics["kvshare_kv_blocks_leaked"] == 0
        assert metrics['kvshare_kv_blocks{state="private"}'] == 0
        assert metrics['kvshare_prefix_cache_tier_hits_total{tier="disk"}'] > 0
        again, cached = ask(base_url)  # now from the pool, where the load put the blocks
        assert again == text and cached > 0
        metrics = scrape(base_url)
        assert metrics["kvshare_kv_tier_checksum_failures_total"] == 0
        assert metrics["kvshare_kv_blocks_leaked"] == 0


def test_a_restart_under_another_kv_dtype_serves_none_of_the_old_entries(tmp_path) -> None:
    with running_server(*tier_flags(tmp_path)) as base_url:
        assert ask(base_url)[1] == 0
    with running_server(*tier_flags(tmp_path), "--kv-cache-dtype", "float16") as base_url:
        metrics = scrape(base_url)
        assert metrics["kvshare_kv_tier_restored_entries"] == 0
        assert metrics["kvshare_kv_tier_ignored_entries"] > 0
        _, cached = ask(base_url)
        assert cached == 0
