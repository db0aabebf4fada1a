"""Tenant isolation under attack, on a real `kvshare serve` with the embedded SmolLM2.

Tenants are API keys (each key is its own prefix-cache namespace, app/serving/records.py).

Timing: tenant B must not learn from its TTFT whether tenant A has a prompt cached (the vLLM
CVE-2025-46570 channel). Each round, A sends a fresh prompt P (now cached for A), then, in a
random order, B sends P and B sends a fresh control prompt of the same length; then A sends P
again. TTFT is the time to the first streamed chunk (official openai client, max_tokens 1).
The rule, two-sided Mann-Whitney U (normal approximation with tie correction) on two samples:
  a difference is *significant* when p < 0.01 and the medians differ by more than 25% of the
  slower one's median (a cache hit saves most of a prefill; noise on a busy machine is
  covered by the p-value, a systematic drift of a few percent by the 25%).
B's probe vs B's control must not differ significantly; A's repeat vs A's first send (the
cache at work, the same rule) must. Prompts are random token ids, so no two share a prefix.

Flood: with `max_cached_blocks_per_namespace`, B sending unique prompts until the pool has
turned over evicts its own blocks, and A's hot prefix keeps its cached_tokens; with the cap
off the same flood evicts it (cached_tokens 0), which shows the flood is big enough.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Iterator

import openai
import pytest

from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
KEYS_ENV = {"KVSHARE_API_KEYS": f"{KEY_A},{KEY_B}"}
TIMING_PROMPT_TOKENS = 256  # a fresh prefill costs 16 blocks of compute; a hit, one token
TIMING_ROUNDS = 8
ALPHA = 0.01
MIN_RELATIVE_DIFFERENCE = 0.25
VOCAB = (200, 40_000)  # ordinary SmolLM2 token ids


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation, tie-corrected)."""
    ranked = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(ranked)
    tie_term, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1  # ties share their mean rank
        tie_term += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(x), len(y)
    rank_sum_x = sum(r for r, (_, group) in zip(ranks, ranked, strict=True) if group == 0)
    u = rank_sum_x - n1 * (n1 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance == 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(variance)  # with continuity correction
    return min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def is_significant(x: list[float], y: list[float]) -> tuple[bool, str]:
    p = mann_whitney_p(x, y)
    mx, my = statistics.median(x), statistics.median(y)
    relative = abs(mx - my) / max(mx, my)
    verdict = p < ALPHA and relative > MIN_RELATIVE_DIFFERENCE
    return verdict, f"p={p:.2g}, medians {mx * 1e3:.0f} ms vs {my * 1e3:.0f} ms ({relative:.0%})"


def test_the_rank_test_against_known_values() -> None:
    # Exact separation of 10 vs 10: U = 0, z = (50 - 0.5) / sqrt(175), p = 0.00018.
    assert mann_whitney_p(list(range(10)), list(range(10, 20))) == pytest.approx(1.8e-4, rel=0.02)
    assert mann_whitney_p([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0  # identical samples
    # Interleaved samples (1 3 5 ... vs 2 4 6 ...): U = 45 of 100, far from significant.
    assert mann_whitney_p(list(range(1, 20, 2)), list(range(2, 21, 2))) > 0.5


def client_for(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=300)


def ttft(client: openai.OpenAI, model: str, prompt: list[int]) -> float:
    """Seconds to the first streamed chunk carrying a choice (its one token)."""
    start = time.perf_counter()
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
    assert first is not None, "the stream carried no choice"
    return first


@pytest.fixture(scope="module")
def timing_server() -> Iterator[str]:
    # No shadow audits: a sampled hit's recompute would add to one step at random.
    with running_server("--audit-sample-rate", "0", env=KEYS_ENV) as url:
        yield url


def probe_rounds(measure, fresh, rng: random.Random) -> tuple[bool, str, bool, str]:
    """TIMING_ROUNDS rounds: A uses a fresh item (a prompt, a schema), B sends it and a fresh
    control in a random order (load drift must not favour either side), A sends it again.
    measure(tenant, item) -> seconds. Returns (leaks, B probe vs control, works, A repeat vs
    A first), each verdict by is_significant."""
    samples: dict[str, list[float]] = {"a fresh": [], "a cached": [], "b probe": [], "b ctl": []}
    for _ in range(TIMING_ROUNDS):
        used = fresh()
        samples["a fresh"].append(measure("a", used))
        probes = [("b probe", used), ("b ctl", fresh())]
        rng.shuffle(probes)
        for name, item in probes:
            samples[name].append(measure("b", item))
        samples["a cached"].append(measure("a", used))
    leaks, cross = is_significant(samples["b probe"], samples["b ctl"])
    works, within = is_significant(samples["a cached"], samples["a fresh"])
    print(f"\nB probe vs B control: {cross}\nA cached vs A fresh: {within}")
    faster = statistics.median(samples["a cached"]) < statistics.median(samples["a fresh"])
    return leaks, cross, works and faster, within


def test_tenant_b_cannot_tell_from_ttft_what_tenant_a_cached(timing_server: str) -> None:
    clients = {"a": client_for(timing_server, KEY_A), "b": client_for(timing_server, KEY_B)}
    model = clients["a"].models.list().data[0].id
    rng = random.Random(15)

    def fresh_prompt() -> list[int]:
        return [rng.randint(*VOCAB) for _ in range(TIMING_PROMPT_TOKENS)]

    for client in clients.values():  # warm-up: first-request costs stay out of the samples
        ttft(client, model, fresh_prompt())
    measure = lambda tenant, prompt: ttft(clients[tenant], model, prompt)  # noqa: E731
    leaks, cross, works, within = probe_rounds(measure, fresh_prompt, rng)
    assert not leaks, f"B's TTFT tells A's cached prompt from a fresh one: {cross}"
    assert works, f"the cache made no significant difference within tenant A: {within}"


def answer_seconds(client: openai.OpenAI, model: str, schema: dict) -> float:
    """Seconds for a one-token answer constrained by `schema` (its grammar compiled, or taken
    from the cache); the prompt is shorter than a block, so no prefix cache is involved."""
    start = time.perf_counter()
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    return time.perf_counter() - start


def slow_schema(rng: random.Random) -> dict:
    """24 patterned string fields: ~0.1 s of compile on a 2-core CPU, a fresh grammar each."""
    pattern = {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"}
    properties = {f"field_{rng.randrange(10**9)}_{i}": pattern for i in range(24)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def test_tenant_b_cannot_tell_from_latency_which_schema_tenant_a_used(timing_server) -> None:
    """The grammar cache is per namespace: B's request with A's schema compiles it anew, as
    a schema nobody used does; A's own repeat is a cache hit (the same rule as above)."""
    clients = {"a": client_for(timing_server, KEY_A), "b": client_for(timing_server, KEY_B)}
    model = clients["a"].models.list().data[0].id
    rng = random.Random(16)
    for client in clients.values():  # warm-up
        answer_seconds(client, model, slow_schema(rng))
    measure = lambda tenant, schema: answer_seconds(clients[tenant], model, schema)  # noqa: E731
    leaks, cross, works, within = probe_rounds(measure, lambda: slow_schema(rng), rng)
    assert not leaks, f"B's latency tells A's schema from a fresh one: {cross}"
    assert works, f"the grammar cache made no significant difference within A: {within}"


# -- the flood ------------------------------------------------------------------------------
FLOOD_BLOCKS = 64  # the pool: B's flood (24 prompts x 4 blocks) turns it over 1.5 times
FLOOD_CAP = 16
HOT_PROMPT_TOKENS = 65  # 4 full blocks of 16 cached, then 64 tokens reused per request
NUM_FLOOD_PROMPTS = 24


@pytest.fixture(scope="module", params=[FLOOD_CAP, None], ids=["cap-on", "cap-off"])
def flood_server(request) -> Iterator[tuple[str, int | None]]:
    flags = ["--num-kv-blocks", str(FLOOD_BLOCKS), "--audit-sample-rate", "0"]
    if request.param is not None:
        flags += ["--max-cached-blocks-per-namespace", str(request.param)]
    with running_server(*flags, env=KEYS_ENV) as url:
        yield url, request.param


def cached_tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> int:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_flooding_tenant_cannot_evict_another_tenants_hot_prefix(flood_server) -> None:
    base_url, cap = flood_server
    a, b = client_for(base_url, KEY_A), client_for(base_url, KEY_B)
    model = a.models.list().data[0].id
    rng = random.Random(16)
    hot = [rng.randint(*VOCAB) for _ in range(HOT_PROMPT_TOKENS)]
    assert cached_tokens(a, model, hot) == 0
    assert cached_tokens(a, model, hot) == 64  # hot: 4 full blocks reused
    evictions_before = scrape(base_url)["kvshare_kv_evictions_total"]
    for _ in range(NUM_FLOOD_PROMPTS):
        flood = [rng.randint(*VOCAB) for _ in range(HOT_PROMPT_TOKENS)]
        assert cached_tokens(b, model, flood) == 0
    metrics = scrape(base_url)
    assert metrics["kvshare_kv_evictions_total"] > evictions_before  # the pool did turn over
    assert cached_tokens(a, model, hot) == (64 if cap is not None else 0)
    metrics = scrape(base_url)
    assert metrics["kvshare_kv_blocks_leaked"] == 0
    assert metrics['kvshare_kv_blocks{state="private"}'] == 0
