"""The prefix-cache auditor on a tiny random Llama: normal traffic audits clean (or drift),
drilled faults are caught, quarantined and healed, audits give way under load, write
violations fail only their request, and a leaked reference shows up in the leak audit.

Block arithmetic (block size 16): a finished request of L prompt and G = 12 generated tokens
leaves floor((L + G - 1) / 16) of its blocks in the tree; a later request reuses its leading
tokens that match, at most all but its last prompt token.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.audit import auditor as auditor_module
from engine.audit.auditor import Verdict, is_sampled
from engine.core.errors import FaultInjectionDisabled, InvalidFaultTarget, UnknownFaultKind
from engine.core.protocol import EngineRequest, FinishReason
from engine.llm_engine import LLMEngine
from tests.engine import engine_helpers as base
from tests.engine.engine_helpers import GREEDY, VOCAB, assert_all_blocks_free

# tiny_model_dir: the module-scoped tiny random Llama (tests/engine/conftest.py)
OK_VERDICTS = (Verdict.CLEAN, Verdict.DRIFT)


def tokens(num: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(num)]


def make_engine(model_dir: str, **overrides) -> LLMEngine:
    settings = dict(audit_sample_rate=1.0, enable_fault_injection=True, audit_max_pending=16)
    return base.make_engine(model_dir, **{**settings, **overrides})


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """reference(prompt): greedy output of an engine with the cache off (memoized)."""
    engine = base.make_engine(tiny_model_dir, enable_prefix_cache=False)
    memo: dict[tuple[int, ...], list[int]] = {}

    def output(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = engine.generate([prompt], GREEDY)[0].token_ids[0]
        return memo[tuple(prompt)]

    return output


def drive(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY) -> dict[str, dict]:
    """Add the prompts together; step until requests and audits are done, checking integrity
    after every step. Per request: tokens, cached tokens, finish reason, error."""
    empty = {"tokens": [], "cached": None, "finish": None, "error": None}
    results = {request_id: dict(empty, tokens=[]) for request_id in prompts}
    for request_id, prompt in prompts.items():
        engine.add_request(EngineRequest(request_id, prompt, params))
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = results[output.request_id]
            result["tokens"] += [t for c in output.outputs for t in c.new_token_ids]
            result["cached"] = output.num_cached_tokens
            result["error"] = output.error or result["error"]
            result["finish"] = next((c.finish_reason for c in output.outputs), result["finish"])
        engine.scheduler.check_integrity()
    return results


def run_one(engine: LLMEngine, request_id: str, prompt: list[int]) -> dict:
    return drive(engine, {request_id: prompt})[request_id]


def record_published_audit_diffs(engine: LLMEngine) -> list[float]:
    """The audit diffs of every snapshot the engine publishes from now on, in order."""
    published: list[float] = []
    step = engine.step

    def step_and_record():
        outputs = step()
        published.extend(engine.latest_stats.audit_max_abs_diffs)
        return outputs

    engine.step = step_and_record
    return published


def audits_of(engine: LLMEngine, request_id: str) -> list:
    return [r for r in engine.auditor.recent_results if r.request_id == request_id]


BASE = tokens(40, seed=1)
P48 = tokens(48, seed=2)
# (name, primer, probe, cached tokens of the probe)
PREFIX_CASES = [
    ("identical", BASE, BASE, 39),
    ("shared prefix, other suffix", BASE, BASE[:33] + tokens(10, seed=3), 33),
    ("partial block", BASE, BASE[:21] + tokens(6, seed=4), 21),
    ("on a block boundary", P48, P48[:32] + tokens(7, seed=5), 32),
    ("a prefix of the cached prompt", P48, P48[:20], 19),
]


@pytest.mark.parametrize(
    ("primer", "probe", "num_cached"),
    [case[1:] for case in PREFIX_CASES],
    ids=[case[0] for case in PREFIX_CASES],
)
def test_prefix_cases_audit_without_corruption(
    tiny_model_dir, reference, primer, probe, num_cached
):
    engine = make_engine(tiny_model_dir)
    published = record_published_audit_diffs(engine)
    first, second = run_one(engine, "primer", primer), run_one(engine, "probe", probe)
    assert (first["cached"], second["cached"]) == (0, num_cached)
    assert [first["tokens"], second["tokens"]] == [reference(primer), reference(probe)]
    [result] = audits_of(engine, "probe")
    assert result.verdict in OK_VERDICTS
    assert result.num_cached_tokens == num_cached
    assert result.greedy_token_matches is True  # the logits were compared
    assert result.quarantined_block_ids == []
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audit_corruptions, stats.num_audits_dropped) == (1, 0, 0)
    assert published == [result.max_abs_diff]  # in exactly one step's snapshot
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "audit_max_tokens_per_step"), [(2048, 256), (16, 7)]
)
def test_shared_prefix_and_multi_turn_traffic_is_never_corruption(
    tiny_model_dir, reference, max_num_batched_tokens, audit_max_tokens_per_step
):
    """The cached KV was computed in other chunks and batches than the audit's recompute
    (tiny budgets chunk both differently): numerics stay far inside the tolerance."""
    engine = make_engine(
        tiny_model_dir,
        max_num_batched_tokens=max_num_batched_tokens,
        audit_max_tokens_per_step=audit_max_tokens_per_step,
    )
    system = tokens(50, seed=6)
    prompts = {f"q{i}": system + tokens(5 + i, seed=10 + i) for i in range(6)}
    results = drive(engine, prompts)
    turn1 = run_one(engine, "turn1", tokens(30, seed=7))
    turn2_prompt = [*tokens(30, seed=7), *turn1["tokens"], *tokens(5, seed=8)]
    turn2 = run_one(engine, "turn2", turn2_prompt)
    assert turn2["cached"] == 32  # 30 + 12 - 1 computed: two full blocks
    for request_id, prompt in prompts.items():
        assert results[request_id]["tokens"] == reference(prompt), request_id
    assert turn2["tokens"] == reference(turn2_prompt)
    num_hits = sum(r["cached"] > 0 for r in results.values()) + 1  # + turn2
    assert num_hits >= 5  # the queries share the system prompt's full blocks
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audit_corruptions, stats.num_audits_dropped) == (
        num_hits,
        0,
        0,
    )
    results = list(engine.auditor.recent_results)
    assert all(r.verdict in OK_VERDICTS for r in results)
    assert max(r.max_error for r in results) < engine.auditor.tolerance / 10
    assert_all_blocks_free(engine)


def test_bfloat16_numerics_stay_inside_the_bfloat16_tolerance(tiny_model_dir):
    """In bfloat16 the chunked, batched cached path and the recompute differ by a few ulps:
    drift at most, never corruption, with a margin to the 0.25 threshold."""
    engine = make_engine(
        tiny_model_dir, dtype="bfloat16", max_num_batched_tokens=16, audit_max_tokens_per_step=7
    )
    system = tokens(50, seed=6)
    results = drive(engine, {f"q{i}": system + tokens(5 + i, seed=10 + i) for i in range(6)})
    stats = engine.stats()
    assert stats.num_audits == sum(r["cached"] > 0 for r in results.values()) >= 5
    assert stats.num_audit_corruptions == 0
    assert engine.auditor.tolerance == 0.25
    assert max(r.max_error for r in engine.auditor.recent_results) < engine.auditor.tolerance / 10
    assert_all_blocks_free(engine)


def test_a_corrupted_block_is_caught_quarantined_and_healed(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    run_one(engine, "prime", BASE)  # 40 + 11 computed tokens: blocks 0..2 cached
    tree = engine.kv_cache_manager.prefix_cache
    first_block = tree.recent_path_block_ids()[0]
    report = engine.inject_fault("corrupt_block")
    assert (report.kind, report.block_ids) == ("corrupt_block", [first_block])

    # The hit runs on, reading the bad block; its own blocks after it (its outputs fill a third
    # block) are never cached.
    hit = run_one(engine, "hit", BASE)
    assert hit["cached"] == 39 and hit["error"] is None
    [result] = audits_of(engine, "hit")
    assert result.verdict is Verdict.CORRUPTION
    assert result.bad_block_ids == [first_block]
    assert first_block in result.quarantined_block_ids
    assert not set(result.quarantined_block_ids) & set(tree.tree_block_ids())
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audit_corruptions) == (1, 1)
    assert stats.num_quarantined_blocks == len(result.quarantined_block_ids) == 3

    after = run_one(engine, "after", BASE)  # nothing of the bad path is left to match
    again = run_one(engine, "again", BASE)  # reuses the fresh blocks of "after"
    assert (after["cached"], again["cached"]) == (0, 39)
    assert after["tokens"] == again["tokens"] == reference(BASE)
    assert audits_of(engine, "again")[0].verdict in OK_VERDICTS
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audit_corruptions) == (2, 1)
    assert_all_blocks_free(engine)


def test_a_wrong_block_mapping_is_caught_on_both_prefixes(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    prompt_p, prompt_q = tokens(40, seed=11), tokens(40, seed=12)
    run_one(engine, "p", prompt_p)
    run_one(engine, "q", prompt_q)
    tree = engine.kv_cache_manager.prefix_cache
    q_first, p_first = tree.recent_path_block_ids()[0], min(tree.tree_block_ids())
    report = engine.inject_fault("wrong_block")  # Q's first block <-> a block off Q's path
    assert report.block_ids == [q_first, p_first]
    engine.scheduler.check_integrity()  # references and ownership still add up

    # Each prefix still maps to its own block, which now holds the other prefix's KV.
    for name, prompt, bad_block in (("q2", prompt_q, q_first), ("p2", prompt_p, p_first)):
        result = run_one(engine, name, prompt)
        assert result["cached"] == 39 and result["error"] is None
        [audit] = audits_of(engine, name)
        assert audit.verdict is Verdict.CORRUPTION
        assert audit.bad_block_ids == [bad_block]
    assert engine.stats().num_audit_corruptions == 2
    for name, prompt in (("q3", prompt_q), ("p3", prompt_p)):
        result = run_one(engine, name, prompt)
        assert result["cached"] == 0
        assert result["tokens"] == reference(prompt)
    assert_all_blocks_free(engine)


def test_audits_are_dropped_when_the_queue_is_full(tiny_model_dir):
    engine = make_engine(tiny_model_dir, audit_max_pending=1)
    run_one(engine, "prime", BASE)
    drive(engine, {f"r{i}": BASE for i in range(4)})  # admitted together: four hits at once
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audits_dropped, stats.num_audit_corruptions) == (1, 3, 0)
    assert_all_blocks_free(engine)


def test_audits_are_dropped_when_the_engine_leaves_no_budget(tiny_model_dir, monkeypatch):
    """Four hits whose one uncached token each fill the 4-token budget, then four decodes a
    step: the audits never get a token and are dropped after MAX_IDLE_STEPS steps."""
    monkeypatch.setattr(auditor_module, "MAX_IDLE_STEPS", 5)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=4, max_num_seqs=4)
    run_one(engine, "prime", BASE)
    results = drive(engine, {f"r{i}": BASE for i in range(4)})
    assert all(r["cached"] == 39 and r["error"] is None for r in results.values())
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audits_dropped) == (0, 4)
    assert_all_blocks_free(engine)


def test_a_long_audit_runs_in_chunks_over_several_steps(tiny_model_dir):
    engine = make_engine(tiny_model_dir, audit_max_tokens_per_step=5)
    run_one(engine, "prime", P48)
    engine.add_request(EngineRequest("hit", P48, GREEDY))  # 12 steps: 1 prefill, 11 decodes
    for _ in range(9):  # 45 of the 48 prompt tokens recomputed
        engine.step()
    assert (engine.auditor.num_pending, engine.stats().num_audits) == (1, 0)
    engine.step()
    assert (engine.auditor.num_pending, engine.stats().num_audits) == (0, 1)
    assert engine.auditor.recent_results[0].verdict in OK_VERDICTS
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_a_write_violation_fails_only_its_request(tiny_model_dir, reference, monkeypatch):
    """A simulated bug maps the victim's next write into a cached block: the victim ends
    with an error, the block is quarantined, the other requests finish as usual."""
    engine = make_engine(tiny_model_dir)
    run_one(engine, "prime", P48)
    kv = engine.kv_cache_manager
    cached_block = kv.prefix_cache.tree_block_ids()[0]
    allocate_slots = kv.allocate_slots

    def buggy_allocate_slots(seq, num_new_tokens):
        is_allocated = allocate_slots(seq, num_new_tokens)
        if is_allocated and seq.request_id == "victim" and seq.num_output_tokens == 3:
            index = seq.num_computed_tokens // kv.block_size
            kv.pool.incref(cached_block)  # the victim takes a reference: accounting holds
            kv.pool.decref(seq.block_ids[index])
            seq.block_ids[index] = cached_block
        return is_allocated

    monkeypatch.setattr(kv, "allocate_slots", buggy_allocate_slots)
    others = {"a": tokens(20, seed=13), "b": tokens(35, seed=14)}
    results = drive(engine, {"victim": tokens(25, seed=15), **others})
    victim = results["victim"]
    assert victim["finish"] is FinishReason.ERROR
    assert "write into a shared block" in victim["error"] and len(victim["tokens"]) == 3
    for request_id, prompt in others.items():
        assert results[request_id]["error"] is None
        assert results[request_id]["tokens"] == reference(prompt)
    stats = engine.stats()
    assert stats.num_write_violations == 1
    assert stats.num_quarantined_blocks == 3  # the cached block and the two cached after it
    assert cached_block not in kv.prefix_cache.tree_block_ids()
    assert run_one(engine, "prime-again", P48)["cached"] == 0
    assert_all_blocks_free(engine)


def test_the_leak_audit_sees_an_extra_reference(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    run_one(engine, "prime", BASE)
    engine.step()  # idle: the leak check runs
    assert engine.stats().num_leaked_blocks == 0
    block_id = engine.kv_cache_manager.prefix_cache.tree_block_ids()[0]
    engine.kv_cache_manager.pool.incref(block_id)  # a reference nobody accounts for
    engine.step()
    assert engine.stats().num_leaked_blocks == 1
    engine.kv_cache_manager.pool.decref(block_id)
    engine.step()
    assert engine.stats().num_leaked_blocks == 0


def test_fault_injection_is_refused_unless_enabled(tiny_model_dir):
    engine = make_engine(tiny_model_dir, enable_fault_injection=False)
    run_one(engine, "prime", BASE)
    blocks = engine.kv_cache_manager.cached_block_ids()
    with pytest.raises(FaultInjectionDisabled, match="disabled"):
        engine.inject_fault("corrupt_block")
    assert run_one(engine, "hit", BASE)["cached"] == 39
    assert engine.stats().num_audit_corruptions == 0
    assert engine.kv_cache_manager.cached_block_ids() == blocks


def test_fault_injection_rejects_bad_kinds_and_targets(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidFaultTarget, match="not in the prefix cache"):
        engine.inject_fault("corrupt_block")  # nothing cached yet
    run_one(engine, "prime", tokens(20, seed=16))  # 20 + 11 computed: one block cached
    with pytest.raises(UnknownFaultKind, match="unknown fault kind"):
        engine.inject_fault("flip_bits")
    with pytest.raises(InvalidFaultTarget, match="another cached block"):
        engine.inject_fault("wrong_block")
    with pytest.raises(InvalidFaultTarget, match="not in the prefix cache"):
        engine.inject_fault("corrupt_block", block_id=100)


def test_sampling_is_a_hash_of_the_request_id_and_touches_no_global_rng(tiny_model_dir):
    ids = [f"req-{i}" for i in range(2000)]
    assert not any(is_sampled(i, 0.0) for i in ids) and all(is_sampled(i, 1.0) for i in ids)
    low, high = {i for i in ids if is_sampled(i, 0.3)}, {i for i in ids if is_sampled(i, 0.6)}
    assert low < high and 0.25 < len(low) / len(ids) < 0.35

    engine = make_engine(tiny_model_dir)
    run_one(engine, "prime", BASE)
    python_state, torch_state = random.getstate(), torch.random.get_rng_state()
    engine.inject_fault("corrupt_block")
    run_one(engine, "hit", BASE)
    assert engine.stats().num_audit_corruptions == 1
    assert random.getstate() == python_state
    assert torch.equal(torch.random.get_rng_state(), torch_state)


def test_no_audit_without_sampling(tiny_model_dir):
    engine = make_engine(tiny_model_dir, audit_sample_rate=0.0)
    run_one(engine, "prime", BASE)
    assert run_one(engine, "hit", BASE)["cached"] == 39
    stats = engine.stats()
    assert (stats.num_audits, stats.num_audits_dropped) == (0, 0)
