"""The prefix cache through the HTTP API: the extreme prefix set and tenant isolation.

Every case primes one server with the prefix cache on and one with it off (`--no-prefix-cache`),
then sends a probe. The greedy outputs must be equal on both, and the probe's
`usage.prompt_tokens_details.cached_tokens` must be exactly what the cache rule gives:

- a finished request with L prompt and G generated tokens leaves its first
  floor((L + G - 1) / 16) full blocks of (prompt + output) in the tree (the last generated
  token has no KV yet);
- a probe reuses its leading tokens that equal the tree's, token by token from position 0
  (inside a partially matching block too), at most len(probe) - 1 of them (the last prompt
  token is always computed for its logits).

Every case uses its own cache_salt (and its own content) so cases never share blocks; each
primer must therefore find nothing cached. Output lengths are fixed with ignore_eos.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.runtime.loader import resolve_model_dir
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16  # config/cpu.yaml
MAX_TOKENS = 8
Prompt = list[int] | str | list[dict[str, str]]  # token ids | completion text | chat messages


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int


class Server:
    """One running kvshare server, spoken to with plain httpx."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=f"{base_url}/v1", headers=headers, timeout=120.0)

    def post(self, prompt: Prompt, salt: str | None, **extra: Any) -> httpx.Response:
        """A greedy, fixed-length request: chat for a message list, completions otherwise."""
        body = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}
        if salt is not None:
            body["cache_salt"] = salt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.http.post("/chat/completions", json={**body, "messages": prompt})
        return self.http.post("/completions", json={**body, "prompt": prompt})

    def ask(self, prompt: Prompt, salt: str | None = None) -> Reply:
        response = self.post(prompt, salt)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        usage = data["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return Reply(text, usage["prompt_tokens"], cached)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(EngineConfig()))


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    """(cache on, cache off), both on SmolLM2 with config/cpu.yaml."""
    with running_server() as on_url, running_server("--no-prefix-cache") as off_url:
        on, off = Server(on_url), Server(off_url)
        yield on, off
        on.http.close()
        off.http.close()


def token_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt as the server tokenizes it (the test checks prompt_tokens agrees)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], dict):
        encoded = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return list(prompt)


def common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def expected_cached(primer_ids: list[int], probe_ids: list[int]) -> int:
    """cached_tokens of the probe after the primer finished with MAX_TOKENS tokens."""
    shared = common_prefix(primer_ids, probe_ids)
    # Beyond the primer the tree holds its output tokens, which this rule does not know.
    assert shared < len(primer_ids) or len(probe_ids) <= len(primer_ids)
    num_tree_tokens = BLOCK_SIZE * ((len(primer_ids) + MAX_TOKENS - 1) // BLOCK_SIZE)
    return min(shared, num_tree_tokens, len(probe_ids) - 1)


def ids(seed: int, length: int) -> list[int]:
    """Ordinary (non-special) token ids; a different seed gives a different first token."""
    rng = random.Random(seed)
    return [1000 + 100 * seed] + [rng.randrange(1000, 40000) for _ in range(length - 1)]


def run_case(
    servers: tuple[Server, Server], salt: str, primer: Prompt, probe: Prompt, tokenizer
) -> int:
    """Primer then probe on both servers; checks outputs equal; returns the probe's cached count."""
    on, off = servers
    with_cache = [on.ask(primer, salt), on.ask(probe, salt)]
    without_cache = [off.ask(primer, salt), off.ask(probe, salt)]
    for prompt, cached, plain in zip((primer, probe), with_cache, without_cache, strict=True):
        assert cached.text == plain.text
        assert cached.prompt_tokens == plain.prompt_tokens == len(token_ids(tokenizer, prompt))
        assert plain.cached_tokens == 0
    assert with_cache[0].cached_tokens == 0  # the case's content is new to the cache
    return with_cache[1].cached_tokens


# ------------------------------------------------------------------- token-id cases

P30, P40, P45, P48, P60 = ids(1, 30), ids(8, 40), ids(2, 45), ids(3, 48), ids(4, 60)
OTHER = ids(5, 16)

# (name, primer, probe, expected cached tokens of the probe), with MAX_TOKENS = 8:
# 30 + 8 - 1 = 37 -> 2 blocks (32 tokens) in the tree; 45 + 7 -> 3 (48); 48 + 7 -> 3 (48).
TOKEN_CASES = [
    ("identical, last token inside a cached block", P30, P30, 29),
    ("identical, last token past the cached blocks", P40, P40, 32),
    ("identical but for the last token", P45, [*P45[:-1], OTHER[0]], 44),
    ("shared prefix ends on a block boundary", P48, P48[:32] + OTHER, 32),
    ("shared prefix ends one token past a boundary", P48, P48[:33] + OTHER, 33),
    ("probe is exactly two cached blocks", P48, P48[:32], 31),
    ("conversation truncated from the front", P60, P60[20:] + OTHER[:10], 0),
]


@pytest.mark.parametrize(
    ("primer", "probe", "expected"),
    [case[1:] for case in TOKEN_CASES],
    ids=[case[0] for case in TOKEN_CASES],
)
def test_token_id_prompts(servers, tokenizer, request, primer, probe, expected):
    assert expected_cached(primer, probe) == expected  # the table agrees with the rule
    assert run_case(servers, request.node.callspec.id, primer, probe, tokenizer) == expected


# ------------------------------------------------------------------- text cases

STORY = (
    "Tell me a short story about a lighthouse keeper who befriends a seagull, "
    "a lost fisherman and the storm that brought them together one winter night"
)
EMOJI = "🦊🌲🏔️ Emoji trail: 👩‍👩‍👧‍👦 family, 🇯🇵 flag, 🧑🏽‍🚀 astronaut, ❤️‍🔥 heart, 🎉🎉 and then"
CJK = "东京的春天很美丽，樱花盛开的时候，人们在公园里散步。日本語の文章も少し混ぜます。한국어도"
COMBINING = (
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e, n\u0303an\u0303o, "
    "Zalgo: Z\u0336a\u0337l\u0338g\u0334o and"
)

TEXT_CASES = [
    (
        "empty system prompt",
        [{"role": "system", "content": ""}, {"role": "user", "content": STORY + "."}],
        [{"role": "system", "content": ""}, {"role": "user", "content": STORY + "?"}],
    ),
    ("emoji", EMOJI + " finally 🚀", EMOJI + " lastly 🛸"),
    ("CJK", CJK + "조금", CJK + "많이"),
    ("combining marks", COMBINING + " fi\u0301n", COMBINING + " e\u0301nd"),
]


@pytest.mark.parametrize(
    ("primer", "probe"), [case[1:] for case in TEXT_CASES], ids=[case[0] for case in TEXT_CASES]
)
def test_text_prompts(servers, tokenizer, request, primer, probe):
    expected = expected_cached(token_ids(tokenizer, primer), token_ids(tokenizer, probe))
    assert expected > BLOCK_SIZE  # at least one full block and a partial one are reused
    assert run_case(servers, request.node.callspec.id, primer, probe, tokenizer) == expected


def test_zero_width_space_stops_sharing_exactly_there(servers, tokenizer):
    text = STORY + ", told by the seagull itself in the first person."
    position = text.index("fisherman") + 4  # fish\u200berman
    probe = text[:position] + "\u200b" + text[position:]
    primer_ids, probe_ids = token_ids(tokenizer, text), token_ids(tokenizer, probe)
    # The token holding the zero-width space is the first that differs; everything before it
    # tokenizes the same (the ids of the text before the insertion point, but for the last
    # one, which may merge with the inserted character).
    divergence = common_prefix(primer_ids, probe_ids)
    before = tokenizer.encode(text[:position])
    assert divergence in (len(before) - 1, len(before))
    assert divergence % BLOCK_SIZE != 0  # sharing stops inside a block, not at its edge
    expected = expected_cached(primer_ids, probe_ids)
    assert expected == divergence
    assert run_case(servers, "zero-width space", text, probe, tokenizer) == expected


# ------------------------------------------------------------------- too long for the window

KV_STATES = ("private", "shared", "cached")


def cache_counters(base_url: str) -> dict[str, float]:
    metrics = scrape(base_url)
    names = [
        "kvshare_prefix_cache_queries_total",
        "kvshare_prefix_cache_hits_total",
        "kvshare_prefill_tokens_total",
        *(f'kvshare_kv_blocks{{state="{state}"}}' for state in KV_STATES),
    ]
    return {name: metrics[name] for name in names}


def test_prompt_longer_than_the_context_window_is_rejected_and_caches_nothing(servers):
    on, off = servers
    salt = "too long"
    primer = ids(6, 40)
    max_model_len = on.http.get("/models").json()["data"][0]["max_model_len"]
    too_long = primer + [1000 + i % 30000 for i in range(max_model_len)]
    first = on.ask(primer, salt)
    assert off.ask(primer, salt).text == first.text
    before = cache_counters(on.base_url)
    assert before['kvshare_kv_blocks{state="private"}'] == 0  # the primer let go of its blocks
    for server in (on, off):
        response = server.post(too_long, salt)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert cache_counters(on.base_url) == before  # nothing looked up, computed or held
    again = on.ask(primer, salt)
    assert (again.text, again.cached_tokens) == (first.text, 32)  # 40 + 7 -> 2 blocks


def test_no_block_is_left_held_or_leaked(servers):
    for server in servers:
        metrics = scrape(server.base_url)
        assert metrics['kvshare_kv_blocks{state="private"}'] == 0
        assert metrics['kvshare_kv_blocks{state="shared"}'] == 0
        assert metrics["kvshare_kv_blocks_leaked"] == 0
    assert scrape(servers[1].base_url)['kvshare_kv_blocks{state="cached"}'] == 0


# ------------------------------------------------------------------- tenants


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    with running_server("--api-keys", "k1,k2") as url:
        yield url


def test_api_keys_never_share_cached_blocks(keyed_url):
    tenant_1, tenant_2 = Server(keyed_url, "k1"), Server(keyed_url, "k2")
    prompt = ids(7, 40)  # 40 + 7 -> 2 blocks in the tree; a repeat reuses 32
    replies = [
        tenant_1.ask(prompt),
        tenant_1.ask(prompt),
        tenant_2.ask(prompt),
        tenant_2.ask(prompt),
        tenant_1.ask(prompt, salt="narrower"),  # cache_salt narrows the tenant's namespace
    ]
    assert [reply.cached_tokens for reply in replies] == [0, 32, 0, 32, 0]
    assert len({reply.text for reply in replies}) == 1
