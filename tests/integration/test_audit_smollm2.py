"""The prefix-cache auditor on a real server (SmolLM2, config/cpu.yaml, every hit audited).

Normal traffic (a shared system prompt, and extreme prefix cases) audits without corruption;
a drilled corruption of a cached block is caught at the next hit on it, quarantined, and the
request after that answers like one that shares nothing with the cache (another cache_salt).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

MAX_TOKENS = 4  # short answers: this CPU test must stay quick
SYSTEM = (
    "You are the help desk of a mountain railway. Trains leave every half hour from seven to "
    "eight; a return ticket costs forty francs, twenty for children, and dogs ride for free."
)
QUESTIONS = [
    "When does the first train leave?",
    "How much is a ticket for a child?",
    "Can I bring my dog?",
]
AUDIT_COUNTERS = (
    "kvshare_cache_audits_total",
    'kvshare_cache_audit_mismatches_total{kind="corruption"}',
    'kvshare_cache_audit_mismatches_total{kind="drift"}',
    "kvshare_cache_quarantined_blocks_total",
    "kvshare_cache_write_violations_total",
    "kvshare_cache_audits_dropped_total",
)
DRIFTS = 'kvshare_cache_audit_mismatches_total{kind="drift"}'


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=120.0)

    def ask(self, prompt: str | list[int] | list[dict], salt: str | None = None) -> dict:
        """A greedy, fixed-length request; returns {"text", "cached"}."""
        body = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        if salt is not None:
            body["cache_salt"] = salt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            response = self.http.post("/v1/chat/completions", json={**body, "messages": prompt})
        else:
            response = self.http.post("/v1/completions", json={**body, "prompt": prompt})
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"text": text, "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"]}

    def audits(self) -> dict[str, float]:
        metrics = scrape(self.base_url)
        return {name: metrics[name] for name in AUDIT_COUNTERS}

    def wait_audits(self, num_audits: int, timeout_s: float = 30.0) -> dict[str, float]:
        """Audits may finish a step or two after their request: wait for the count."""
        deadline = time.monotonic() + timeout_s
        while (counters := self.audits())["kvshare_cache_audits_total"] < num_audits:
            assert time.monotonic() < deadline, counters
            time.sleep(0.2)
        return counters


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    flags = ("--audit-sample-rate", "1.0", "--audit-max-pending", "16", "--enable-fault-injection")
    with running_server(*flags) as url:
        yield Client(url)


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [1000 + 100 * seed] + [rng.randrange(1000, 40000) for _ in range(length - 1)]


def test_normal_traffic_is_audited_without_corruption(client):
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    first = client.ask(chats[0], salt="workload")
    with ThreadPoolExecutor(2) as pool:  # the others together, both sharing the prompt
        replies = [first, *pool.map(lambda chat: client.ask(chat, salt="workload"), chats[1:])]
    p45 = ids(1, 45)
    primer_probes = [  # all but the last token; one token past a block boundary; emoji + CJK
        (p45, [[*p45[:-1], 1234], p45[:33] + ids(2, 6)]),
        ("Emoji 🦊🌲🏔️ and CJK 東京の春 then", ["Emoji 🦊🌲🏔️ and CJK 東京の春 now"]),
    ]
    for primer, probes in primer_probes:
        client.ask(primer, salt="cases")
        replies += [client.ask(probe, salt="cases") for probe in probes]
    num_hits = sum(reply["cached"] > 0 for reply in replies)
    assert num_hits >= len(QUESTIONS) - 1 + 3
    counters = client.wait_audits(num_hits)
    drifts = counters.pop(DRIFTS)
    assert counters == {
        "kvshare_cache_audits_total": num_hits,
        'kvshare_cache_audit_mismatches_total{kind="corruption"}': 0,
        "kvshare_cache_quarantined_blocks_total": 0,
        "kvshare_cache_write_violations_total": 0,
        "kvshare_cache_audits_dropped_total": 0,
    }
    metrics = scrape(client.base_url)
    assert metrics["kvshare_cache_audit_max_abs_diff_count"] == num_hits
    assert metrics['kvshare_cache_audit_max_abs_diff_bucket{le="0.1"}'] == num_hits
    # Drift (numerics) is allowed, but only where the numbers differ. An audit whose largest
    # difference is within 1e-6 is clean: its relative error is at most that, below the clean
    # tolerance (float32: 64 epsilons, 7.6e-6), and the greedy token flips only on a tie within
    # 1e-6. The drift counter (from verdicts) and the histogram (from diffs) must agree on it.
    within_1e6 = metrics['kvshare_cache_audit_max_abs_diff_bucket{le="1e-06"}']
    assert 0 <= drifts <= num_hits - within_1e6


def test_an_answer_reused_as_the_next_prompt_audits_without_corruption(client):
    """A second turn reads the first answer's KV from the cache. That KV was computed for
    generated tokens, which on an AMX CPU take the FMAs while the audit recomputes them as
    prompt tokens, on the tiles (step_inputs.tile_rows): other summation orders, so drift at
    most (within float32 rounding), never corruption."""
    before = client.wait_audits(client.audits()["kvshare_cache_audits_total"])
    diffs_before = scrape(client.base_url)
    body = {"temperature": 0, "max_tokens": 40, "ignore_eos": True, "cache_salt": "turns"}
    first = client.http.post("/v1/completions", json={**body, "prompt": SYSTEM}).json()
    follow_up = SYSTEM + first["choices"][0]["text"] + " So when is the last train?"
    second = client.http.post("/v1/completions", json={**body, "prompt": follow_up}).json()
    # at least one block (16 tokens) of the answer came from the cache
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] + 16, (cached, first["usage"])
    counters = client.wait_audits(before["kvshare_cache_audits_total"] + 1)
    for name in (
        'kvshare_cache_audit_mismatches_total{kind="corruption"}',
        "kvshare_cache_quarantined_blocks_total",
    ):
        assert counters[name] == before[name], name
    metrics = scrape(client.base_url)  # this test's audits, each within 0.1 (float32 drift)
    count = "kvshare_cache_audit_max_abs_diff_count"
    within = 'kvshare_cache_audit_max_abs_diff_bucket{le="0.1"}'
    audited = metrics[count] - diffs_before[count]
    assert audited >= 1 and metrics[within] - diffs_before[within] == audited


def test_a_corrupted_block_is_caught_and_the_prefix_recomputed(client):
    prompt = ids(6, 48)  # 48 + 3 computed tokens: three blocks cached
    before = client.wait_audits(client.audits()["kvshare_cache_audits_total"])
    primer = client.ask(prompt, salt="drill")
    drill = client.http.post("/debug/faults", json={"kind": "corrupt_block"})
    assert drill.status_code == 200, drill.text
    assert drill.json()["kind"] == "corrupt_block" and len(drill.json()["block_ids"]) == 1

    assert client.ask(prompt, salt="drill")["cached"] == 47  # reads the bad block: caught
    counters = client.wait_audits(before["kvshare_cache_audits_total"] + 1)
    corruptions = 'kvshare_cache_audit_mismatches_total{kind="corruption"}'
    assert counters[corruptions] - before[corruptions] == 1
    quarantined = "kvshare_cache_quarantined_blocks_total"
    assert counters[quarantined] - before[quarantined] == 3  # the block and the two after it

    after = client.ask(prompt, salt="drill")
    reference = client.ask(prompt, salt="shares-nothing")
    assert (after["cached"], reference["cached"]) == (0, 0)
    assert after["text"] == reference["text"] == primer["text"]
    metrics = scrape(client.base_url)
    # The two requests after the drill reused nothing, so the drill's hit was the one audit of
    # this test, and it counted as corruption only (never also as drift).
    audits = "kvshare_cache_audits_total"
    assert metrics[audits] - before[audits] == 1
    assert metrics[corruptions] - before[corruptions] == 1
    assert metrics[DRIFTS] == before[DRIFTS]
    assert metrics["kvshare_kv_blocks_leaked"] == 0
