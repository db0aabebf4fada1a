"""cache_diagnostics end to end: a real `kvshare serve` (embedded SmolLM2), the official SDK
reading the extension object from model_extra, one reason per test (docs/cache-diagnostics.md).

The server has two API keys (two tenants), a 64-block pool (so a flood evicts), the audit on
every hit and fault injection (so a drill quarantines). Tests separate their prompts with
cache_salt, so their order does not matter.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from benchmarks.cache_diagnostics import run_phase
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

KEY_A, KEY_B, OPERATOR = "diag-key-a", "diag-key-b", "diag-operator"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    flags = ("--num-kv-blocks", "64", "--audit-sample-rate", "1.0", "--enable-fault-injection")
    keys = ("--api-keys", f"{KEY_A},{KEY_B}", "--operator-keys", OPERATOR)
    with running_server(*flags, *keys) as url:
        yield url


@pytest.fixture(scope="module")
def alice(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_A)


@pytest.fixture(scope="module")
def bob(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_B)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client, messages, salt, diagnostics=True):
    response = client.chat.completions.create(
        model=model_of(client),
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        extra_body={"cache_diagnostics": diagnostics, "cache_salt": salt},
    )
    return response


def weather_tool(description: str) -> dict:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    function = {"name": "get_weather", "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def complete(client, prompt, salt):
    response = client.completions.create(
        model=model_of(client),
        prompt=prompt,
        max_tokens=1,
        temperature=0.0,
        extra_body={"cache_diagnostics": True, "cache_salt": salt},
    )
    return response.model_extra["cache_diagnostics"]


def random_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(length)]


CONVERSATION = [
    {"role": "system", "content": "You answer questions about the solar system briefly."},
    {"role": "user", "content": "Which planet is the largest one of them all?"},
    {"role": "assistant", "content": "Jupiter is the largest planet in the solar system."},
    {"role": "user", "content": "And the smallest?"},
]


def test_the_answer_names_the_message_where_prompts_diverge(alice):
    chat(alice, CONVERSATION, "diverged")
    edited = [*CONVERSATION[:2], {"role": "assistant", "content": "Saturn, I think."}]
    diagnostics = chat(alice, [*edited, CONVERSATION[3]], "diverged").model_extra[
        "cache_diagnostics"
    ]
    assert diagnostics["reason"] == "diverged"
    assert diagnostics["segment"] == {"kind": "message", "message_index": 2, "role": "assistant"}
    assert diagnostics["text_at"].startswith("Saturn")
    assert diagnostics["block_size"] == BLOCK_SIZE
    assert diagnostics["matched_tokens"] == diagnostics["first_miss_index"] > 0


def test_a_changed_tool_description_diverges_in_the_tools_segment(alice):
    def ask(description: str, diagnostics):
        return alice.chat.completions.create(
            model=model_of(alice),
            messages=CONVERSATION[:2],
            tools=[weather_tool(description)],
            max_tokens=1,
            temperature=0.0,
            extra_body={"cache_diagnostics": diagnostics, "cache_salt": "tools"},
        )

    first = ask("The current weather in a city, in degrees Celsius.", True)
    second = ask("The weather forecast for tomorrow in a city.", {"compare_to": first.id})
    diagnostics = second.model_extra["cache_diagnostics"]
    comparison = diagnostics["compare_to"]  # the exact token where the two prompts part
    assert comparison["segment"] == diagnostics["segment"] == {"kind": "tools"}
    assert comparison["text_at"].startswith(" weather forecast")
    assert diagnostics["reason"] == "diverged"
    # The cache matches token by token (a partial block is copied): the miss is exactly there.
    assert diagnostics["first_miss_index"] == comparison["first_difference_index"] > 0


def test_a_full_hit_has_no_miss_point(alice):
    chat(alice, CONVERSATION, "full")
    diagnostics = chat(alice, CONVERSATION, "full").model_extra["cache_diagnostics"]
    assert diagnostics["reason"] in ("full_hit", "below_block")
    if diagnostics["reason"] == "full_hit":
        assert diagnostics["first_miss_index"] is None
        assert diagnostics["matched_tokens"] == diagnostics["prompt_tokens"] - 1


def test_a_prompt_shorter_than_a_block_is_below_block(alice):
    prompt = random_ids(1, 10)
    complete(alice, prompt, "short")
    diagnostics = complete(alice, prompt, "short")
    assert diagnostics["reason"] == "below_block"
    assert diagnostics["segment"] == {"kind": "prompt"}
    assert (diagnostics["matched_tokens"], diagnostics["first_miss_index"]) == (0, 0)


def test_an_evicted_prefix_is_named_evicted(alice):
    prompt = random_ids(2, 64)
    complete(alice, prompt, "evicted")
    for seed in range(10, 16):  # 6 x 400 tokens: more than the 64-block pool holds
        complete(alice, random_ids(seed, 400), "flood")
    diagnostics = complete(alice, prompt, "evicted")
    assert diagnostics["reason"] == "evicted"


def test_another_tenant_is_never_revealed(alice, bob, base_url):
    messages = [{"role": "user", "content": "Alice's secret plan: build a rocket by Friday."}]
    before = scrape(base_url, OPERATOR)[
        'kvshare_prefix_cache_miss_tokens_total{reason="other_namespace"}'
    ]
    chat(alice, messages, "tenant")
    answer = chat(bob, messages, "tenant")
    diagnostics = answer.model_extra["cache_diagnostics"]
    after = scrape(base_url, OPERATOR)[
        'kvshare_prefix_cache_miss_tokens_total{reason="other_namespace"}'
    ]
    assert after - before == answer.usage.prompt_tokens  # the operator's metric knows
    # Bob learns nothing: the same answer as for a prompt nobody ever sent.
    never_sent = [{"role": "user", "content": "Bobs's secret plan: build a rocket by Friday."}]
    fresh = chat(bob, never_sent, "tenant-fresh").model_extra["cache_diagnostics"]
    assert diagnostics["reason"] == fresh["reason"] == "no_earlier_prefix"
    assert diagnostics["matched_tokens"] == fresh["matched_tokens"] == 0


def test_compare_to_finds_the_first_difference_of_the_tenants_own_prompts(alice, bob):
    first = chat(alice, CONVERSATION, "compare", diagnostics=False)
    changed = [CONVERSATION[0], {"role": "user", "content": "Which moon is the largest?"}]
    answer = chat(alice, changed, "compare", diagnostics={"compare_to": first.id})
    comparison = answer.model_extra["cache_diagnostics"]["compare_to"]
    assert comparison["id"] == first.id
    assert comparison["segment"] == {"kind": "message", "message_index": 1, "role": "user"}
    assert comparison["text_at"].startswith(" moon")
    with pytest.raises(openai.NotFoundError) as refused:
        chat(bob, changed, "compare", diagnostics={"compare_to": first.id})
    assert "Which planet" not in str(refused.value.body)
    assert refused.value.body["param"] == "cache_diagnostics.compare_to"


def test_a_quarantined_prefix_is_named(alice, base_url):
    prompt = random_ids(3, 48)
    complete(alice, prompt, "drill")
    headers = {"Authorization": f"Bearer {OPERATOR}"}  # drills are the operator's
    drill = httpx.post(f"{base_url}/debug/faults", json={"kind": "corrupt_block"}, headers=headers)
    assert drill.status_code == 200, drill.text
    complete(alice, prompt, "drill")  # reads the bad block; the audit quarantines it
    for _ in range(100):
        if scrape(base_url, OPERATOR)["kvshare_cache_quarantined_blocks_total"] > 0:
            break
        httpx.get(f"{base_url}/health")
    diagnostics = complete(alice, prompt, "drill")
    assert diagnostics["reason"] == "quarantined"


def test_miss_tokens_sum_to_prompt_tokens_not_served(alice, base_url):
    def misses() -> float:
        metrics = scrape(base_url, OPERATOR)
        return sum(v for k, v in metrics.items() if k.startswith("kvshare_prefix_cache_miss"))

    before = misses()
    not_served = 0
    for messages in (CONVERSATION, CONVERSATION, CONVERSATION[:2]):
        usage = chat(alice, messages, "sums").usage
        not_served += usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert misses() - before == not_served


def test_the_drill_points_at_the_timestamp(alice):
    before = run_phase(alice, 8, dynamic_first=True, salt="drill-before")
    after = run_phase(alice, 8, dynamic_first=False, salt="drill-after")
    assert before["hit_rate"] < 0.10 < 0.70 < after["hit_rate"]
    example = before["examples"][0]
    assert example["reason"] == "diverged"
    assert example["segment"]["kind"] == "system"
    assert "20:41:0" in example["text_before"] + example["text_at"]


def test_the_tenant_report_finds_the_timestamp(bob, base_url):
    before = run_phase(bob, 8, dynamic_first=True, salt="report")
    point = before["examples"][0]["first_miss_index"]
    headers = {"Authorization": f"Bearer {KEY_B}"}
    url = f"{base_url}/debug/cache_report"
    report = httpx.get(url, headers=headers, params={"cache_salt": "report"}, timeout=30).json()
    (finding,) = report["findings"]
    assert finding["from_token"] == point
    assert finding["segment"]["kind"] == "system"
    assert finding["message"].startswith("the system prompt carries per-request content at tok")
    command = [sys.executable, "-m", "app.cli", "cache-report", base_url, "--api-key", KEY_B]
    printed = subprocess.run(
        [*command, "--cache-salt", "report"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"finding: {finding['message']}" in printed
    refused = httpx.get(f"{base_url}/debug/cache_report", timeout=30)
    assert refused.status_code == 401  # keyed like the other debug routes
