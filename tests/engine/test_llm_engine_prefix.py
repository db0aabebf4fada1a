"""LLMEngine with the prefix cache on a tiny random Llama: greedy outputs equal the engine
with the cache off (itself checked against HF generate) and cached_tokens is exact.

What cached_tokens counts: the leading prompt tokens whose KV a request reused at its first
admission, from full cached blocks plus, where the match ends inside a cached block, the
matching tokens of that block (copied). Only full, computed blocks are cached: a finished
request of L prompt tokens and G outputs leaves floor((L + G - 1) / 16) blocks of its tokens.
A match never covers a prompt's last token (it is computed for its logits).
"""

from __future__ import annotations

import random

import pytest

from engine.core.protocol import EngineRequest
from engine.llm_engine import LLMEngine
from tests.engine.engine_helpers import GREEDY, VOCAB, assert_all_blocks_free, make_engine
from tests.oracle import hf_greedy

# tiny_model_dir and hf_model: the tiny random Llama and its HF twin (tests/engine/conftest.py).
BLOCK_SIZE = 16  # the engine default
ANSWER_LEN = GREEDY.max_tokens


def tokens(num: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(num)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """reference(prompts): greedy outputs of the engine with the cache off (one batch for
    the prompts not seen before), memoized per prompt."""
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    memo: dict[tuple[int, ...], list[int]] = {}

    def outputs(prompts: list[list[int]]) -> list[list[int]]:
        new = list({tuple(p): p for p in prompts if tuple(p) not in memo}.values())
        for prompt, result in zip(new, engine.generate(new, GREEDY), strict=True):
            memo[tuple(prompt)] = result.token_ids[0]
        return [memo[tuple(p)] for p in prompts]

    return outputs


def drive(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, dict]:
    """Add requests together, step until all finish (integrity checked after every step);
    per request: choice 0's tokens and the reported cached tokens."""
    results = {r.request_id: {"tokens": [], "cached": None, "stored": None} for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            results[output.request_id]["tokens"] += output.outputs[0].new_token_ids
            results[output.request_id]["cached"] = output.num_cached_tokens
            results[output.request_id]["stored"] = output.num_stored_prompt_tokens
        engine.scheduler.check_integrity()
    return results


def one_after_another(engine: LLMEngine, prompts: list[list[int]], **fields) -> list[dict]:
    """Each prompt runs alone to completion, in order, through the same engine."""
    return [
        drive(engine, [EngineRequest(f"seq{i}", prompt, GREEDY, **fields)])[f"seq{i}"]
        for i, prompt in enumerate(prompts)
    ]


BASE = tokens(40, seed=1)
P32, P33 = tokens(32, seed=2), tokens(33, seed=2)
CHANGED_21 = [*BASE[:21], (BASE[21] + 1) % VOCAB, *BASE[22:]]
CHANGED_32 = [*BASE[:32], (BASE[32] + 1) % VOCAB, *BASE[33:]]
assert BASE[5] != BASE[0]


@pytest.mark.parametrize(
    ("first", "second", "num_cached"),
    [
        # 40 + 11 computed tokens: 3 blocks (48 tokens) cached; the cap leaves token 39.
        (BASE, BASE, 39),
        (BASE, [*BASE[:-1], (BASE[-1] + 1) % VOCAB], 39),  # all but the last token
        (BASE, CHANGED_21, 21),  # 16 from block 0 + 5 copied from block 1
        (BASE, CHANGED_32, 32),  # blocks 0, 1: the change is the first token of block 2
        (BASE, [*BASE[5:], *tokens(5, seed=3)], 0),  # truncated from the front
        (BASE, BASE[:20], 19),  # a prefix of a cached prompt
        (P32 + tokens(8, 4), P32 + tokens(8, 5), 32),  # shared prefix ends on a block
        (P33 + tokens(8, 4), P33 + tokens(8, 5), 33),  # ... and one token past it
    ],
    ids=["same", "last", "middle", "boundary", "front", "prefix", "block", "block+1"],
)
def test_second_prompt_reuses_exactly_the_shared_tokens(
    tiny_model_dir, reference, first, second, num_cached
):
    engine = make_engine(tiny_model_dir)
    results = one_after_another(engine, [first, second])
    assert [r["cached"] for r in results] == [0, num_cached]
    assert [r["tokens"] for r in results] == reference([first, second])
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        len(first) + len(second),
        num_cached,
    )
    assert stats.num_prefill_tokens == len(first) + len(second) - num_cached
    assert_all_blocks_free(engine)


def test_the_next_turn_reuses_the_prompt_and_the_answer(tiny_model_dir, hf_model, reference):
    engine = make_engine(tiny_model_dir)
    turn1 = tokens(30, seed=6)
    [first] = one_after_another(engine, [turn1])
    assert first["tokens"] == hf_greedy(hf_model, turn1, ANSWER_LEN)
    turn2 = [*turn1, *first["tokens"], *tokens(5, seed=7)]
    [second] = one_after_another(engine, [turn2])
    # 30 + 12 - 1 computed tokens: blocks 0, 1 full and cached; block 2 had 9 tokens.
    assert second["cached"] == 32
    assert [second["tokens"]] == reference([turn2])
    assert second["tokens"] == hf_greedy(hf_model, turn2, ANSWER_LEN)


@pytest.mark.parametrize(
    ("first", "second", "num_stored"),
    [
        (BASE, BASE, 0),  # the tree holds all three of its blocks already
        (BASE, CHANGED_21, 40 - 21),  # 21 served (5 copied from block 1); the rest is new
        (BASE, [*BASE[5:], *tokens(5, seed=3)], 40),  # nothing shared
    ],
    ids=["same", "middle", "front"],
)
def test_a_request_reports_the_prompt_tokens_it_added_to_the_cache(
    tiny_model_dir, first, second, num_stored
):
    """40 prompt + 11 computed answer tokens fill 3 blocks: all 40 prompt tokens are stored
    by the first request (its last block at its finish); the second adds what the tree lacked."""
    engine = make_engine(tiny_model_dir)
    results = one_after_another(engine, [first, second])
    assert [r["stored"] for r in results] == [40, num_stored]
    together = drive(engine, [EngineRequest(f"x{i}", tokens(40, 9), GREEDY) for i in range(2)])
    assert sorted(r["stored"] for r in together.values()) == [0, 40]  # one computed it
    off = make_engine(tiny_model_dir, enable_prefix_cache=False)
    assert one_after_another(off, [first])[0]["stored"] == 0


def test_cache_salt_keeps_tenants_apart(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    cached = [
        one_after_another(engine, [BASE], cache_salt=salt)[0]["cached"]
        for salt in ("tenant-a", "tenant-b", "tenant-a", None)
    ]
    assert cached == [0, 0, 39, 0]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 64])
def test_concurrent_requests_compute_a_shared_prefix_once(
    tiny_model_dir, hf_model, reference, max_num_batched_tokens
):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=max_num_batched_tokens)
    system = tokens(200, seed=8)
    suffixes = [tokens(8 + i, seed=20 + i) for i in range(8)]
    prompts = [system + suffix for suffix in suffixes]
    results = drive(engine, [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    num_suffix_tokens = sum(len(s) for s in suffixes)
    stats = engine.stats()
    assert stats.num_prefill_tokens <= 200 + num_suffix_tokens + BLOCK_SIZE  # acceptance 2
    # Exactly: r0 computes everything, each other request only its suffix (its 200 shared
    # tokens are 12 cached blocks + 8 tokens copied from block 12, which r0 filled).
    assert stats.num_prefill_tokens == 200 + num_suffix_tokens
    assert [results[f"r{i}"]["cached"] for i in range(8)] == [0] + [200] * 7
    assert [results[f"r{i}"]["tokens"] for i in range(8)] == reference(prompts)
    assert results["r7"]["tokens"] == hf_greedy(hf_model, prompts[7], ANSWER_LEN)
    assert_all_blocks_free(engine)


def test_a_small_pool_evicts_the_least_recently_used_prompts(tiny_model_dir, reference):
    # Each request holds 4 blocks of 16 (40 + 11 tokens) and leaves 3 cached (its twin
    # finds them, and its own copies are swapped back for them): 12 blocks run short at the
    # fourth prompt's decode (p0 loses its tail block), then the fifth's admission evicts
    # the rest of p0 and its decode p1's tail block.
    engine = make_engine(tiny_model_dir, num_kv_blocks=12)
    prompts = [tokens(40, seed=30 + i) for i in range(5)]
    twice = [p for prompt in prompts for p in (prompt, prompt)]
    results = one_after_another(engine, twice)
    assert [r["cached"] for r in results] == [0, 39] * 5  # the repeat always finds its twin
    assert [r["tokens"] for r in results] == reference(twice)
    assert engine.stats().num_evictions == 4
    assert one_after_another(engine, [prompts[0]])[0]["cached"] == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("policy", ["fcfs", "longest-prefix-first"])
def test_shared_prefixes_under_preemption_match_the_reference(tiny_model_dir, reference, policy):
    engine = make_engine(tiny_model_dir, num_kv_blocks=14, scheduling_policy=policy)
    shared = tokens(40, seed=40)
    prompts = [shared + tokens(3 + i, seed=41 + i) for i in range(6)]
    prompts += [tokens(30, seed=50 + i) for i in range(2)]
    requests = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = drive(engine, requests)
    assert [results[f"r{i}"]["tokens"] for i in range(8)] == reference(prompts)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for number, prompt in enumerate(prompts):  # a recomputed prompt is never counted twice
        result = results[f"r{number}"]
        assert result["cached"] + result["stored"] <= len(prompt), result
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("second", "num_volatile", "reason"),
    [
        ([*BASE[:5], (BASE[5] + 1) % VOCAB, *BASE[6:]], 20, "volatile_prefix"),  # miss at 0
        ([*BASE[:5], (BASE[5] + 1) % VOCAB, *BASE[6:]], 0, "diverged"),
        (CHANGED_32, 20, "below_block"),  # the miss lies past the volatile tokens
        (tokens(40, seed=11), 20, "no_earlier_prefix"),  # nothing matched: not the line
    ],
    ids=["inside", "not-marked", "past", "nothing"],
)
def test_a_miss_inside_the_volatile_prefix_is_counted_as_such(
    tiny_model_dir, second, num_volatile, reason
):
    engine = make_engine(tiny_model_dir)
    drive(engine, [EngineRequest("first", BASE, GREEDY)])
    request = EngineRequest("second", second, GREEDY, num_volatile_prefix_tokens=num_volatile)
    engine.add_request(request)
    diagnoses = []
    while engine.has_unfinished_requests():
        diagnoses += [output.cache_diagnosis for output in engine.step()]
    assert diagnoses[0].reason == reason
    assert dict(engine.stats().prefix_cache_miss_tokens)[reason] >= len(second) - 32
