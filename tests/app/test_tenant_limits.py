"""Per-tenant limits: a tenant over one gets a 429 with Retry-After (counted per tenant and
reason) while another tenant's requests complete; the load is released at every end."""

from __future__ import annotations

import asyncio

import pytest
from helpers import chat_body, make_settings, open_client
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import TenantLabels

pytestmark = pytest.mark.anyio

KEYS = ("key-alpha", "key-beta")
ALPHA, BETA = ({"Authorization": f"Bearer {key}"} for key in KEYS)


def tenant_samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                samples[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def post(client, headers, **fields):
    body = chat_body(max_tokens=3, **fields)
    return await client.post("/v1/chat/completions", json=body, headers=headers)


async def until(condition) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition never held")


@pytest.mark.parametrize(
    ("limit", "pause_after_tokens", "reason"),
    [
        ("max_waiting_requests_per_tenant", 0, "waiting"),  # paused before the first output
        ("max_running_requests_per_tenant", 1, "running"),  # paused after it
    ],
)
async def test_over_its_limit_a_tenant_gets_429_while_another_completes(
    engine, limit, pause_after_tokens, reason
) -> None:
    engine.pause_after_tokens = pause_after_tokens
    settings = make_settings(api_keys=KEYS, operator_keys=("op",), **{limit: 2})
    async with open_client(engine, settings) as client:
        alpha = [asyncio.create_task(post(client, ALPHA)) for _ in range(2)]
        await until(lambda: len(engine.requests) == 2 and engine.paused.is_set())
        await asyncio.sleep(0.01)  # both have reached the pause point
        refused = await post(client, ALPHA)
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == f"tenant_{reason}_limit"
        beta = asyncio.create_task(post(client, BETA))  # another tenant is not limited
        await until(lambda: len(engine.requests) == 3)
        engine.resume.set()
        responses = await asyncio.gather(*alpha, beta)
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert (await post(client, ALPHA)).status_code == 200  # the load was released
        metrics = (await client.get("/metrics", headers={"x-api-key": "op"})).text
        serving = client.app.state.kvshare.serving
        assert serving.tenants.loads.loads == {}
    labels = TenantLabels(16)
    alpha_label, beta_label = (
        labels.of(engine.requests[0].tenant),
        labels.of(engine.requests[2].tenant),
    )
    rejections = tenant_samples(metrics, "kvshare_tenant_rejections_total")
    # The default tenant's series are exported at 0 from the start (for rate() in the alerts).
    assert {key: value for key, value in rejections.items() if value} == {
        (("reason", reason), ("tenant", alpha_label)): 1.0
    }
    assert {value for key, value in rejections.items() if ("tenant", "default") in key} == {0.0}
    generated = tenant_samples(metrics, "kvshare_tenant_generation_tokens_total")
    assert generated == {(("tenant", alpha_label),): 9.0, (("tenant", beta_label),): 3.0}
    queued = tenant_samples(metrics, "kvshare_tenant_queue_time_seconds_count")
    assert queued == {(("tenant", alpha_label),): 3.0, (("tenant", beta_label),): 1.0}


async def test_waiting_prompt_tokens_limit_counts_this_request(engine) -> None:
    settings = make_settings(api_keys=KEYS, max_waiting_prompt_tokens_per_tenant=12)
    async with open_client(engine, settings) as client:
        ok = await post(client, ALPHA, messages=[{"role": "user", "content": "hi"}])
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] <= 12
        long_text = " ".join(["word"] * 40)
        refused = await post(client, ALPHA, messages=[{"role": "user", "content": long_text}])
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_prompt_tokens_limit"


def test_tenant_labels_are_short_hashes_bounded_in_number() -> None:
    labels = TenantLabels(2)
    first, second = labels.of("tenant-a"), labels.of("tenant-b")
    assert len(first) == 8 and first != second and "tenant" not in first
    assert labels.of("tenant-c") == "other" and labels.of("tenant-a") == first
    assert labels.of(None) == "default"


async def test_a_burst_cannot_pass_the_limit_before_any_of_it_runs(engine) -> None:
    """Admission counts a request in its tenant's load at once: of 20 simultaneous streams
    under a limit of 1, one is served and 19 get a 429; another tenant is not limited; the
    load is empty again at the end."""
    engine.pause_after_tokens = 1
    settings = make_settings(api_keys=KEYS, max_running_requests_per_tenant=1)
    async with open_client(engine, settings) as client:
        burst = [asyncio.create_task(post(client, ALPHA, stream=True)) for _ in range(20)]
        await until(lambda: sum(task.done() for task in burst) == 19)
        beta = asyncio.create_task(post(client, BETA))
        await until(lambda: len(engine.requests) == 2)
        engine.resume.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*burst))
        assert statuses == [200] + [429] * 19
        assert (await beta).status_code == 200
        assert client.app.state.kvshare.serving.tenants.loads.loads == {}


async def test_token_routes_take_a_place_in_their_tenants_load(engine) -> None:
    """Counting tokens templates the whole body too: a tenant at its limit of waiting requests
    gets a 429 there as well; another tenant's counts go on."""
    engine.pause_after_tokens = 0  # the chat request waits for its first output
    settings = make_settings(api_keys=KEYS, max_waiting_requests_per_tenant=1)
    async with open_client(engine, settings) as client:
        waiting = asyncio.create_task(post(client, ALPHA))
        await until(engine.paused.is_set)
        body = {"prompt": "hello"}
        refused = await client.post("/tokenize", json=body, headers=ALPHA)
        assert refused.status_code == 429, refused.text
        assert (await client.post("/tokenize", json=body, headers=BETA)).status_code == 200
        engine.resume.set()
        assert (await waiting).status_code == 200
        assert (await client.post("/tokenize", json=body, headers=ALPHA)).status_code == 200
        assert client.app.state.kvshare.serving.tenants.loads.loads == {}
