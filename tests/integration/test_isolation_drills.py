"""Issue 55's isolation probes as drills: a real `kvshare serve` (embedded SmolLM2) with two
tenant keys and an operator key, each probe sent over HTTP as the issue sent it, each drill
asserting what the server does now (docs/security.md).

1. /metrics is the operator's: no key and a tenant's key get a 401, the operator everything.
2. A tenant cannot tell from its diagnostics or metrics that another tenant sent its prompt.
3. A huge stop_token_ids list is a 400 naming the field, and the server keeps serving.
4. A non-streaming POST /v1/responses whose client leaves is aborted in the engine.
5. One tenant storing responses evicts its own oldest, never another tenant's.
6. A burst under a per-tenant limit of 1 gets 19 of 20 refused; another tenant is served.
7. /health answers while the cache report of a long conversation is computed.
8. A tenant key cannot use /debug/kv_blocks or /debug/faults, nor read another's cache report.
A second server, with tenants and no operator key, shows its tenant view of /metrics (1, 2).

After every drill the server goes idle with every KV block accounted for (leaked 0).
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.server import free_port, running_server, scrape

pytestmark = pytest.mark.integration

KEY_A, KEY_B, OPERATOR = "drill-key-a", "drill-key-b", "drill-operator"
# The operator key as an environment variable: a server without operator_keys only warns
# about it and starts, so the drills show what such a server leaks.
OPERATOR_ENV = {"KVSHARE_OPERATOR_KEYS": OPERATOR}
# One torch thread: the drills' own clients (bursts, probes) share the machine's cores.
COMMON = ("--api-keys", f"{KEY_A},{KEY_B}", "--num-threads", "1")
STORE_MAX_RESPONSES = 5
IDLE_TIMEOUT_S = 15.0

RUNNING = 'kvshare_requests{state="running"}'
WAITING = 'kvshare_requests{state="waiting"}'
HELD_BLOCKS = ('kvshare_kv_blocks{state="private"}', 'kvshare_kv_blocks{state="shared"}')
LEAKED = "kvshare_kv_blocks_leaked"
MISSES = 'kvshare_prefix_cache_miss_tokens_total{{reason="{}"}}'
ABORTED = 'kvshare_requests_total{finish_reason="abort"}'
# Over two blocks of 16 tokens as a completion prompt (at least 35, as the issue probed):
# B's full blocks are cached in B's namespace.
PROBE_TEXT = (
    "Tenant B's private memo: the merger with Northwind closes on the third of March, "
    "and the price per share is forty-two dollars and seventeen cents, not a cent more."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """Two tenants, the operator, a running limit of 1 per tenant, a 5-response store; fault
    injection and KV events on so that their routes have something to guard."""
    store = tmp_path_factory.mktemp("drills") / "responses.sqlite3"
    flags = (
        *("--max-running-requests-per-tenant", "1"),
        *("--store-max-responses", str(STORE_MAX_RESPONSES), "--store-path", str(store)),
        *("--enable-fault-injection", "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"),
    )
    with running_server(*COMMON, *flags, env=OPERATOR_ENV) as url:
        yield url


@pytest.fixture(scope="module")
def tenant_view_server() -> Iterator[str]:
    """Two tenants and no operator key: /metrics is anyone's, as its tenant view."""
    with running_server(*COMMON) as url:
        yield url


@pytest.fixture(autouse=True)
def no_leaked_blocks(request) -> Iterator[None]:
    """After each drill: its server goes idle, no block held, none leaked."""
    yield
    for name, key in (("server", OPERATOR), ("tenant_view_server", None)):
        if name in request.fixturenames:
            metrics = wait_idle(request.getfixturevalue(name), key)
            assert metrics[LEAKED] == 0


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def wait_idle(url: str, key: str | None, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    """/metrics (read with `key`) once nothing runs or waits and no block is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url, key)
        in_flight = metrics[RUNNING] + metrics[WAITING]
        held = sum(metrics[name] for name in HELD_BLOCKS)
        if in_flight == 0 and held == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not idle after {timeout_s} s: {in_flight} in flight, {held} held"
            )
        time.sleep(0.1)


def model_of(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", headers=auth(KEY_A), timeout=10.0)
    return response.json()["data"][0]["id"]


def post(
    url: str, path: str, key: str | None, body: dict, timeout_s: float = 60.0
) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=auth(key), timeout=timeout_s)


def complete(url: str, key: str, prompt: str, **fields) -> httpx.Response:
    """A one-token greedy completion of `prompt`, answered 200."""
    body = {"model": model_of(url), "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    response = post(url, "/v1/completions", key, body | fields)
    assert response.status_code == 200, response.text
    return response


def tenant_label(key: str) -> str:
    """The key's tenant label in kvshare_tenant_* series: a hash of the tenant, itself a hash
    of the key (app/middleware.py ApiKeyMiddleware, app/metrics.py TenantLabels)."""
    tenant = hashlib.sha256(key.encode()).hexdigest()[:16]
    return hashlib.sha256(tenant.encode()).hexdigest()[:8]


def tenant_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("kvshare_tenant_")]


# -- 1. /metrics ------------------------------------------------------------------------------


def test_metrics_answer_only_the_operator(server):
    for key in (KEY_A, KEY_B):
        complete(server, key, "Name a colour.")  # each tenant now has its series
    for key in (None, KEY_A, KEY_B):
        response = httpx.get(f"{server}/metrics", headers=auth(key), timeout=10.0)
        readable = len(tenant_lines(response.text))
        assert response.status_code == 401, f"key {key}: {readable} per-tenant series readable"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_operator_key"
    everything = httpx.get(f"{server}/metrics", headers=auth(OPERATOR), timeout=10.0).text
    for key in (KEY_A, KEY_B):
        assert f'kvshare_tenant_prompt_tokens_total{{tenant="{tenant_label(key)}"}}' in everything


def test_without_operator_keys_metrics_show_no_tenant(tenant_view_server):
    for key in (KEY_A, KEY_B):
        complete(tenant_view_server, key, "Name a colour.")
    for key in (None, KEY_A):
        response = httpx.get(f"{tenant_view_server}/metrics", headers=auth(key), timeout=10.0)
        assert response.status_code == 200
        assert tenant_lines(response.text) == []
        assert tenant_label(KEY_B) not in response.text
    assert "kvshare_kv_blocks_total" in response.text  # the aggregates stay


# -- 2. the miss-reason oracle ----------------------------------------------------------------


def probe_miss_reason(url: str, key: str | None) -> tuple[httpx.Response, dict, dict]:
    """B sends PROBE_TEXT; A sends it with its own cache_salt and cache_diagnostics. Returns A's
    answer and /metrics (read with `key`) before and after A's request."""
    complete(url, KEY_B, PROBE_TEXT)
    before = wait_idle(url, key)
    answer = complete(url, KEY_A, PROBE_TEXT, cache_salt="drill-a", cache_diagnostics=True)
    return answer, before, wait_idle(url, key)


def assert_answers_as_a_fresh_prompt(answer: httpx.Response) -> int:
    """A's answer says nothing of B: a miss with no earlier prefix. Returns its prompt tokens."""
    num_prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    assert num_prompt_tokens >= 35
    diagnostics = answer.json()["cache_diagnostics"]
    assert diagnostics["reason"] == "no_earlier_prefix"
    assert diagnostics["matched_tokens"] == 0
    assert "other_namespace" not in answer.text
    return num_prompt_tokens


def test_a_tenant_cannot_learn_from_miss_reasons_what_another_sent(server):
    answer, before, after = probe_miss_reason(server, OPERATOR)
    num_prompt_tokens = assert_answers_as_a_fresh_prompt(answer)
    other = MISSES.format("other_namespace")
    assert after[other] - before[other] == num_prompt_tokens  # the operator's figure knows
    own_view = httpx.get(f"{server}/metrics", headers=auth(KEY_A), timeout=10.0)
    seen = [line for line in own_view.text.splitlines() if 'reason="other_namespace"' in line]
    assert own_view.status_code == 401, f"A reads /metrics: {seen}"


def test_the_tenant_view_counts_another_namespace_as_no_earlier_prefix(tenant_view_server):
    answer, before, after = probe_miss_reason(tenant_view_server, KEY_A)
    num_prompt_tokens = assert_answers_as_a_fresh_prompt(answer)
    other, none = MISSES.format("other_namespace"), MISSES.format("no_earlier_prefix")
    assert after[other] == before[other] == 0
    assert after[none] - before[none] == num_prompt_tokens


# -- 3. caps ----------------------------------------------------------------------------------


def test_a_huge_stop_token_ids_list_is_refused(server):
    model = model_of(server)
    stop_token_ids = [200 + i % 40_000 for i in range(400_000)]  # in the vocabulary
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
    start = time.perf_counter()
    response = post(
        server, "/v1/chat/completions", KEY_A, body | {"stop_token_ids": stop_token_ids}
    )
    print(f"\n400,000 stop_token_ids answered in {time.perf_counter() - start:.2f} s")
    assert response.status_code == 400, response.text[:200]
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids"
    assert "stop_token_ids" in error["message"] and "max_stop_token_ids" in error["message"]
    again = post(server, "/v1/chat/completions", KEY_A, body | {"stop_token_ids": [2]})
    assert again.status_code == 200  # still serving


# -- 4. a dropped Responses request -----------------------------------------------------------

DROP_AFTER_S = 1.5
ABORT_WITHIN_S = 5.0


def test_a_dropped_responses_request_is_aborted(server):
    model = model_of(server)
    before = wait_idle(server, OPERATOR)
    body = {
        "model": model,
        "input": "Write a very long story about a dragon.",
        "max_output_tokens": 4000,  # minutes of decoding, unless aborted
        "temperature": 0.0,
    }
    with pytest.raises(httpx.ReadTimeout):  # the client leaves mid-generation
        post(server, "/v1/responses", KEY_A, body, timeout_s=DROP_AFTER_S)
    after = wait_idle(server, OPERATOR, timeout_s=ABORT_WITHIN_S)
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[RUNNING] == 0


# -- 5. the response store --------------------------------------------------------------------


SHORT_ANSWER = "Is the sky blue? Answer yes or no."  # three tokens, greedy: "No."


def store_response(url: str, key: str, model: str) -> str:
    body = {"model": model, "input": SHORT_ANSWER, "max_output_tokens": 16, "temperature": 0.0}
    response = post(url, "/v1/responses", key, body | {"store": True})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def stored_status(url: str, key: str, response_id: str) -> int:
    return httpx.get(
        f"{url}/v1/responses/{response_id}", headers=auth(key), timeout=10.0
    ).status_code


def test_a_tenants_stored_responses_never_evict_anothers(server):
    model = model_of(server)
    b_id = store_response(server, KEY_B, model)
    a_ids = [store_response(server, KEY_A, model) for _ in range(6)]
    assert stored_status(server, KEY_B, b_id) == 200
    # Past the bound of 5, A is over its share: its own two oldest went.
    assert [stored_status(server, KEY_A, i) for i in a_ids] == [404, 404, 200, 200, 200, 200]
    assert scrape(server, OPERATOR)["kvshare_stored_responses"] == STORE_MAX_RESPONSES


# -- 6. a burst under a per-tenant limit ------------------------------------------------------

BURST = 20


async def burst_while_b_is_served(url: str, model: str) -> tuple[list[httpx.Response], dict]:
    """BURST streams from A at once; while A's admitted stream runs, one chat of B's. Returns A's
    responses (the refusals read, the streams closed) and B's answer."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Name a planet."}]}
    long_stream = chat | {"max_tokens": 1024, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, headers=auth(KEY_A), timeout=60.0) as alice,
        httpx.AsyncClient(base_url=url, headers=auth(KEY_B), timeout=60.0) as bob,
    ):
        requests = [alice.build_request("POST", "/v1/chat/completions", json=long_stream)]
        requests *= BURST
        responses = await asyncio.gather(*(alice.send(r, stream=True) for r in requests))
        try:
            for response in responses:
                if response.status_code != 200:
                    await response.aread()
            answer = await bob.post("/v1/chat/completions", json=chat | {"max_tokens": 4})
        finally:
            for response in responses:
                await response.aclose()  # a disconnect: the server aborts what runs
    return responses, {"status": answer.status_code, **answer.json()}


def test_a_burst_over_the_tenant_limit_is_refused(server):
    responses, b_answer = asyncio.run(burst_while_b_is_served(server, model_of(server)))
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200] + [429] * (BURST - 1), f"{statuses.count(429)} of {BURST} refused"
    refused = [response for response in responses if response.status_code == 429]
    assert {response.headers["Retry-After"] for response in refused} == {"1"}
    assert {response.json()["error"]["code"] for response in refused} == {"tenant_running_limit"}
    assert b_answer["status"] == 200
    assert b_answer["choices"][0]["finish_reason"] == "length"


# -- 7. /health beside the cache report -------------------------------------------------------

NUM_HISTORY_PROMPTS = 2
NUM_MESSAGES = 201  # 1134 tokens: the report renders 201 prefixes of the latest
HEALTH_SECONDS = 4.0
HEALTH_INTERVAL_S = 0.02
HEALTH_SALT = "health-drill"


def long_conversation(number: int) -> list[dict]:
    """NUM_MESSAGES turns that differ from the other prompts' only in the last one; empty
    turns: the fewest tokens for the most prefixes to render."""
    roles = ("user", "assistant")
    turns = [{"role": roles[i % 2], "content": ""} for i in range(NUM_MESSAGES - 1)]
    return [*turns, {"role": "user", "content": f"Question {number}?"}]


def health_beside_reports(url: str) -> tuple[list[float], list[float]]:
    """/health latencies probed every HEALTH_INTERVAL_S while a thread requests A's cache
    report back to back; and the reports' durations."""
    stop = threading.Event()
    report_seconds: list[float] = []

    def reports() -> None:
        with httpx.Client(base_url=url, headers=auth(KEY_A), timeout=60.0) as client:
            while not stop.is_set():
                start = time.perf_counter()
                response = client.get("/debug/cache_report", params={"cache_salt": HEALTH_SALT})
                response.raise_for_status()
                report_seconds.append(time.perf_counter() - start)

    worker = threading.Thread(target=reports)
    worker.start()
    latencies = []
    try:
        with httpx.Client(base_url=url, timeout=10.0) as client:
            deadline = time.monotonic() + HEALTH_SECONDS
            while time.monotonic() < deadline:
                start = time.perf_counter()
                client.get("/health").raise_for_status()
                latencies.append(time.perf_counter() - start)
                time.sleep(HEALTH_INTERVAL_S)
    finally:
        stop.set()
        worker.join(timeout=120.0)
    return latencies, report_seconds


def test_health_answers_while_a_cache_report_is_computed(server):
    model = model_of(server)
    for number in range(NUM_HISTORY_PROMPTS):
        body = {"model": model, "messages": long_conversation(number), "max_tokens": 1}
        response = post(server, "/v1/chat/completions", KEY_A, body | {"cache_salt": HEALTH_SALT})
        assert response.status_code == 200, response.text
    latencies, report_seconds = health_beside_reports(server)
    p95, report = statistics.quantiles(latencies, n=20)[-1], statistics.median(report_seconds)
    print(
        f"\n/health: {len(latencies)} probes, median {statistics.median(latencies) * 1e3:.0f} ms,"
        f" p95 {p95 * 1e3:.0f} ms, max {max(latencies) * 1e3:.0f} ms;"
        f" {len(report_seconds)} reports, median {report * 1e3:.0f} ms"
    )
    # A report on the event loop holds every probe that arrives meanwhile for up to its
    # whole duration; in a worker thread, a probe waits for a fraction of it at most.
    assert p95 < report / 2, f"/health p95 {p95:.3f} s beside a {report:.3f} s report"


# -- 8. the operator's routes and the cache report --------------------------------------------


def test_tenant_keys_cannot_use_the_operators_routes(server):
    harmless_fault = {"kind": "corrupt_block", "block_id": 10**9}  # no cached block: nothing done
    for key in (KEY_A, KEY_B):
        blocks = httpx.get(f"{server}/debug/kv_blocks", headers=auth(key), timeout=10.0)
        assert blocks.status_code == 401, blocks.text[:200]
        fault = post(server, "/debug/faults", key, harmless_fault)
        assert fault.status_code == 401, fault.text[:200]
        assert fault.json()["error"]["code"] == "invalid_operator_key"
    blocks = httpx.get(f"{server}/debug/kv_blocks", headers=auth(OPERATOR), timeout=10.0)
    assert blocks.status_code == 200
    assert isinstance(blocks.json()["block_hashes"], list)
    fault = post(server, "/debug/faults", OPERATOR, harmless_fault)
    assert fault.status_code == 409  # the engine looked for the block: the drill ran
    assert fault.json()["error"]["code"] == "no_fault_target"


def report_of(url: str, key: str, cache_salt: str | None) -> httpx.Response:
    params = {} if cache_salt is None else {"cache_salt": cache_salt}
    return httpx.get(f"{url}/debug/cache_report", headers=auth(key), params=params, timeout=30.0)


def test_a_cache_report_shows_only_its_own_namespace(server):
    salt = "report-drill"
    num_unsalted = report_of(server, KEY_B, None).json()["num_prompts"]
    for number in range(3):
        complete(server, KEY_B, f"B's order number {number} for the report.", cache_salt=salt)
    assert report_of(server, KEY_B, salt).json()["num_prompts"] == 3
    assert report_of(server, KEY_A, salt).json()["num_prompts"] == 0  # B's salt, A's prompts
    # Another salt is another namespace, in B's own report too.
    assert report_of(server, KEY_B, None).json()["num_prompts"] == num_unsalted
    assert report_of(server, OPERATOR, salt).status_code == 401  # the operator is no tenant
