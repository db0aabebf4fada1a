"""Per-tenant limits on the real engine: a real `kvshare serve` (embedded SmolLM2) with two API
keys and max_running_requests_per_tenant 2, the official SDK (docs/fair-scheduling.md).

Tenant A holds two streams open (both running), so its third request gets a 429 with
Retry-After, while tenant B's requests complete. When A's streams are closed (the server
aborts them), no block is left held or leaked, and A is served again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

KEY_A, KEY_B, OPERATOR = "limits-key-a", "limits-key-b", "limits-operator"
MAX_RUNNING = 2
HELD_BLOCK_STATES = ('kvshare_kv_blocks{state="private"}', 'kvshare_kv_blocks{state="shared"}')
MESSAGES = [{"role": "user", "content": "Name a planet of the solar system."}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    limit = ("--max-running-requests-per-tenant", str(MAX_RUNNING))
    keys = ("--api-keys", f"{KEY_A},{KEY_B}", "--operator-keys", OPERATOR)
    with running_server(*keys, *limit) as url:
        yield url


def client_of(base_url: str, key: str) -> openai.OpenAI:
    # max_retries 0: the SDK would otherwise retry the 429 after its Retry-After.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


def held_blocks(metrics: dict[str, float]) -> float:
    return sum(metrics[name] for name in HELD_BLOCK_STATES)


def wait_idle(base_url: str) -> dict[str, float]:
    """/metrics once no request runs or waits (the engine publishes its stats per step)."""
    for _ in range(200):
        metrics = scrape(base_url, OPERATOR)
        busy = metrics['kvshare_requests{state="running"}']
        busy += metrics['kvshare_requests{state="waiting"}']
        if busy == 0 and held_blocks(metrics) == 0:
            return metrics
        time.sleep(0.1)
    raise AssertionError(f"the server never went idle: {metrics}")


def ask(client: openai.OpenAI, max_tokens: int = 4):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0
    )


def open_stream(client: openai.OpenAI):
    """A long stream, read up to its first token: its request is running from then on."""
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=1024,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:  # the first chunk (the role) may come before the engine's output
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    raise AssertionError("the stream ended before its first token")


def rejected_running(metrics: dict[str, float]) -> float:
    names = [k for k in metrics if k.startswith("kvshare_tenant_rejections_total{")]
    return sum(metrics[k] for k in names if 'reason="running"' in k)


def test_a_tenant_over_its_limit_gets_429s_while_another_completes(base_url):
    alice, bob = client_of(base_url, KEY_A), client_of(base_url, KEY_B)
    idle = wait_idle(base_url)
    streams = [open_stream(alice) for _ in range(MAX_RUNNING)]
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            ask(alice)
        assert refused.value.response.headers["Retry-After"] == "1"
        assert refused.value.body["code"] == "tenant_running_limit"
        answers = [ask(bob) for _ in range(3)]  # B is not limited by A's load
        assert [a.choices[0].finish_reason for a in answers] == ["length"] * 3
        with pytest.raises(openai.RateLimitError):  # A's streams still run: still refused
            ask(alice)
        during = scrape(base_url, OPERATOR)
        assert during['kvshare_requests{state="running"}'] == MAX_RUNNING
    finally:
        for stream in streams:
            stream.close()  # a disconnect: the server aborts both requests
    after = wait_idle(base_url)
    assert rejected_running(after) - rejected_running(idle) == 2
    assert after["kvshare_kv_blocks_leaked"] == idle["kvshare_kv_blocks_leaked"] == 0
    assert held_blocks(after) == held_blocks(idle) == 0  # every block back to free or cached
    blocks = ("free", "cached")
    assert (
        sum(after[f'kvshare_kv_blocks{{state="{s}"}}'] for s in blocks)
        == after["kvshare_kv_blocks_total"]
    )
    assert ask(alice).choices[0].finish_reason == "length"  # A's load was released
