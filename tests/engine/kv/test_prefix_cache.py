"""Prefix cache through KVCacheManager and the scheduler (no torch): exact block ids.

Manager tests drive admit / slot_mapping / insert_prefix / free by hand, the way the
scheduler does; scheduler tests use the simulated runner of engine/simulation.py, which reads
every sampled sequence's context back through its block table (a wrong shared block, a missing
copy or a write into a cached block shows up as a wrong token read back).
"""

from __future__ import annotations

import pytest

from engine.core.batch import BlockCopy
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.simulation import BLOCK_SIZE, make_scheduler
from tests.engine.fakes import Collected, collect, expected_outputs, params, run, step

NAMESPACE = make_namespace("w0")


def make_manager(num_blocks: int = 8) -> KVCacheManager:
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return KVCacheManager(pool, enable_prefix_cache=True)


def make_seq(seq_id: int, token_ids: list[int], namespace=NAMESPACE) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        choice_index=0,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(),
        seed=0,
        cache_namespace=namespace,
    )


def admit_and_compute(manager: KVCacheManager, seq: Sequence, budget: int = 100) -> list[int]:
    """admit(), then the chunk is computed and its full blocks offered to the tree."""
    num_tokens = manager.admit(seq, budget)
    assert num_tokens is not None
    slots = manager.slot_mapping(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.insert_prefix(seq)
    return slots


def refcounts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.pool.refcount(b) for b in block_ids]


# -- manager -----------------------------------------------------------------------------------
def test_a_repeated_prompt_shares_the_full_blocks_and_computes_the_rest() -> None:
    manager = make_manager()
    first = make_seq(0, list(range(10)))
    assert admit_and_compute(manager, first) == list(range(10))
    assert manager.prefix_cache.tree_block_ids() == [0, 1]  # block 2 holds 2 tokens: not full
    assert refcounts(manager, [0, 1, 2]) == [2, 2, 1]
    assert manager.num_inserted_tokens(first) == 8

    second = make_seq(1, list(range(10)))
    assert manager.cached_prefix_len(second) == 8
    assert manager.admit(second, 100) == 2
    assert (second.block_ids, second.num_computed_tokens) == ([0, 1, 3], 8)
    assert manager.take_block_copies() == []
    assert manager.slot_mapping(second, 2) == [12, 13]
    assert refcounts(manager, [0, 1, 3]) == [3, 3, 1]
    manager.check_integrity([first, second])
    assert manager.usage.num_shared_blocks == 2


def test_a_match_ending_inside_a_block_copies_it_and_locks_it() -> None:
    manager = make_manager()
    first = make_seq(0, list(range(12)))
    admit_and_compute(manager, first)  # blocks 0, 1, 2: all full, all cached
    manager.free(first)
    assert manager.usage.num_cached_blocks == 3

    second = make_seq(1, list(range(10)))  # a prefix: the cap leaves token 9 to compute
    assert manager.admit(second, 100) == 1
    assert (second.block_ids, second.num_computed_tokens) == ([0, 1, 3], 9)
    assert manager.take_block_copies() == [BlockCopy(src=2, dst=3)]
    assert manager.num_cow_copies == 1
    assert manager.pool.num_tokens(3) == 2  # the copied token + the one computed now
    assert manager.slot_mapping(second, 1) == [3 * BLOCK_SIZE + 1]
    # Until the chunk is computed (the copy runs before it), the match's node (blocks 0, 1,
    # 2) is locked: block 2 is held by the tree alone, yet it cannot be evicted.
    assert manager.evict(8) == []
    manager.check_integrity([second])
    second.num_computed_tokens += 1
    manager.insert_prefix(second)  # computed: the lock is released
    assert manager.evict(8) == [2]  # blocks 0, 1 are still held by `second`
    manager.free(second)
    assert manager.evict(8) == [1, 0]  # tail first
    assert manager.num_evictions == 3
    assert manager.num_free_blocks == 8
    manager.check_integrity([])


@pytest.mark.parametrize(
    ("position", "block_ids", "copies"),
    [
        (6, [0, 3], [BlockCopy(1, 3)]),  # inside block 1: its 2 matching tokens are copied
        (8, [0, 1], []),  # on a block boundary: full blocks only
        (0, [], []),  # differs at position 0 (truncated from the front): nothing
    ],
)
def test_sharing_stops_exactly_at_the_first_different_token(position, block_ids, copies) -> None:
    manager = make_manager()
    first = make_seq(0, list(range(12)))
    admit_and_compute(manager, first)
    token_ids = list(range(12))
    token_ids[position] = 99
    second = make_seq(1, token_ids)
    assert manager.cached_prefix_len(second) == position
    assert manager.admit(second, 1) == 1
    assert (second.block_ids[: len(block_ids)], second.num_computed_tokens) == (
        block_ids,
        position,
    )
    assert manager.take_block_copies() == copies
    manager.check_integrity([first, second])


def test_namespaces_never_share() -> None:
    manager = make_manager()
    first = make_seq(0, list(range(12)), namespace=make_namespace("w0", None, "tenant-a"))
    admit_and_compute(manager, first)
    for namespace in (make_namespace("w0"), make_namespace("w1", None, "tenant-a")):
        assert manager.cached_prefix_len(make_seq(1, list(range(12)), namespace)) == 0
    same = make_seq(2, list(range(12)), namespace=make_namespace("w0", None, "tenant-a"))
    assert manager.cached_prefix_len(same) == 11


def test_allocation_evicts_cached_blocks_before_it_fails() -> None:
    manager = make_manager(num_blocks=4)
    first = make_seq(0, list(range(8)))
    admit_and_compute(manager, first)
    manager.free(first)  # blocks 0, 1 stay cached; 2, 3 are free
    other = make_seq(1, list(range(100, 116)))  # 4 blocks, shares nothing
    assert not manager.allocate_slots(other, 17)  # 5 blocks: not even after evicting
    assert (other.block_ids, manager.num_evictions) == ([], 0)
    assert manager.admit(other, 16) == 16
    assert other.block_ids == [2, 3, 1, 0]  # evicted tail first, reused oldest-freed first
    assert manager.num_evictions == 2
    manager.check_integrity([other])


def test_an_admission_that_cannot_fit_changes_nothing() -> None:
    manager = make_manager(num_blocks=4)
    first = make_seq(0, list(range(12)))
    admit_and_compute(manager, first)  # holds blocks 0, 1, 2 (cached too): 1 block free
    second = make_seq(1, [*range(10), *range(50, 60)])  # 2 full + 2 partial tokens, 20 total
    assert manager.cached_prefix_len(second) == 10
    assert manager.admit(second, 100) is None  # needs 3 more blocks
    assert (second.block_ids, second.num_computed_tokens) == ([], 0)
    assert manager.take_block_copies() == []
    assert manager.num_cow_copies == 0
    assert refcounts(manager, [0, 1, 2, 3]) == [2, 2, 2, 0]
    manager.check_integrity([first])  # the match's lock was released
    assert manager.admit(second, 2) == 2  # a smaller first chunk fits: 9, 10 into the copy
    assert manager.take_block_copies() == [BlockCopy(src=2, dst=3)]


def test_a_duplicate_computed_alongside_is_swapped_for_the_cached_block() -> None:
    manager = make_manager()
    first, second = make_seq(0, list(range(9))), make_seq(1, list(range(9)))
    for seq in (first, second):  # both admitted before either inserted anything
        assert manager.admit(seq, 100) == 9
    assert (first.block_ids, second.block_ids) == ([0, 1, 2], [3, 4, 5])
    for seq in (first, second):
        manager.slot_mapping(seq, 9)
        seq.num_computed_tokens = 9
        manager.insert_prefix(seq)
    assert second.block_ids == [0, 1, 5]  # its copies of blocks 0, 1 went back to the pool
    assert refcounts(manager, [0, 1, 2, 3, 4, 5]) == [3, 3, 1, 0, 0, 1]
    manager.check_integrity([first, second])


def test_cached_blocks_are_never_written_and_filled_blocks_join_the_tree() -> None:
    manager = make_manager()
    seq = make_seq(0, list(range(6)))
    admit_and_compute(manager, seq)
    assert manager.prefix_cache.tree_block_ids() == [0]
    for position in (6, 7, 8):  # decode: the private block fills, then a new one opens
        seq.output_token_ids.append(position)
        assert manager.allocate_slots(seq, 1)
        assert manager.slot_mapping(seq, 1) == [position]  # blocks 1, 2: slot == position
        seq.num_computed_tokens += 1
        manager.insert_prefix(seq)
    assert manager.prefix_cache.tree_block_ids() == [0, 1]
    assert seq.block_ids == [0, 1, 2]
    assert manager.take_block_copies() == []
    manager.check_integrity([seq])


def test_integrity_sees_a_lock_left_behind() -> None:
    manager = make_manager()
    first = make_seq(0, list(range(8)))
    admit_and_compute(manager, first)
    second = make_seq(1, list(range(8)))
    manager.admit(second, 1)
    with pytest.raises(AssertionError, match="still holds a lock"):
        manager.check_integrity([first])


@pytest.mark.parametrize(
    ("token_ids", "num_shared"),
    [
        (list(range(1, 13)), 12),  # the prompt and both outputs
        ([1, 2, 3, 4, 5, 9], 5),  # differs inside the second block
        (list(range(1, 14)), 12),  # longer than the sequence
        ([0, 2], 0),
        ([], 0),
    ],
)
def test_num_shared_tokens_compares_prompt_and_outputs(token_ids, num_shared) -> None:
    seq = make_seq(0, list(range(1, 11)))
    seq.output_token_ids = [11, 12]
    assert seq.num_shared_tokens(token_ids, BLOCK_SIZE) == num_shared


# -- scheduler ---------------------------------------------------------------------------------
def test_identical_prompts_one_after_another_reuse_all_but_the_last_token() -> None:
    scheduler, runner = make_scheduler(num_blocks=16, enable_prefix_cache=True)
    prompt = list(range(1, 11))
    results = run(scheduler, runner, {0: [EngineRequest("a", prompt, params())]})
    # a computed 10 + 3 tokens: blocks 0, 1, 2 are full and cached (block 3 went back).
    results = run(scheduler, runner, {0: [EngineRequest("b", prompt, params())]}, results)
    first_b = runner.steps[4]
    assert [(s.start_pos, s.token_ids, s.block_ids) for s in first_b.seqs] == [(9, [10], [0, 1, 4])]
    assert first_b.block_copies == [BlockCopy(src=2, dst=4)]
    assert first_b.slot_mapping == [4 * BLOCK_SIZE + 1]
    assert results["a"].tokens == results["b"].tokens == {0: expected_outputs(prompt, 0, 4)}
    assert (results["a"].num_cached_tokens, results["b"].num_cached_tokens) == (0, 9)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 9)
    assert (stats.num_prefill_tokens, stats.num_cow_copies, stats.num_evictions) == (11, 1, 0)
    # b's blocks 0, 1, 2 were cached already; its copy of block 2 (now full) is a duplicate
    # and was swapped back: 3 cached blocks, nothing else held.
    assert (stats.num_cached_blocks, stats.num_free_blocks) == (3, 13)


def test_requests_arriving_together_compute_their_shared_prefix_once() -> None:
    scheduler, runner = make_scheduler(enable_prefix_cache=True)
    prefix = list(range(1, 9))  # 2 blocks
    prompts = {f"r{i}": [*prefix, 20 + i, 30 + i, 40 + i] for i in range(3)}
    arrivals = {0: [EngineRequest(name, p, params()) for name, p in prompts.items()]}
    results = run(scheduler, runner, arrivals)
    # Step 1: only r0; r1 and r2 wait for its blocks. Step 2: they reuse them.
    assert [(s.seq_id, s.start_pos, s.num_tokens) for s in runner.steps[0].seqs] == [(0, 0, 11)]
    assert [(s.seq_id, s.start_pos, s.block_ids) for s in runner.steps[1].seqs] == [
        (0, 11, [0, 1, 2]),
        (1, 8, [0, 1, 3]),
        (2, 8, [0, 1, 4]),
    ]
    assert [results[name].num_cached_tokens for name in prompts] == [0, 8, 8]
    assert scheduler.counters.num_prefill_tokens == 11 + 3 + 3
    for i, (name, prompt) in enumerate(prompts.items()):
        assert results[name].tokens == {0: expected_outputs(prompt, 0, 4)}, i


def test_a_follower_waits_only_while_its_leader_prefills() -> None:
    scheduler, runner = make_scheduler(enable_prefix_cache=True, max_num_batched_tokens=10)
    prompt = list(range(1, 17))  # 4 blocks
    scheduler.add_request(EngineRequest("leader", prompt, params()))
    step(scheduler, runner)  # leader computes 0..9; blocks 0, 1 are cached after the step
    scheduler.add_request(EngineRequest("follower", [*prompt, 50], params()))
    step(scheduler, runner)  # leader computes 10..15; the follower waits for blocks 2, 3
    assert [s.seq_id for s in runner.steps[1].seqs] == [0]
    step(scheduler, runner)  # leader decodes; the follower reuses all 16 tokens
    assert [(s.seq_id, s.start_pos, s.token_ids) for s in runner.steps[2].seqs] == [
        (0, 16, [17]),
        (1, 16, [50]),
    ]
    results = run(scheduler, runner, {})
    assert results["follower"].num_cached_tokens == 16
    assert scheduler.counters.num_prefill_tokens == 16 + 1


def test_without_the_cache_nobody_is_held_and_everything_is_computed() -> None:
    scheduler, runner = make_scheduler()
    prompts = {f"r{i}": [*range(1, 9), 20 + i] for i in range(3)}
    run(scheduler, runner, {0: [EngineRequest(n, p, params()) for n, p in prompts.items()]})
    assert len(runner.steps[0].seqs) == 3
    assert scheduler.counters.num_prefill_tokens == 27
    assert (scheduler.counters.prefix_cache_queries, scheduler.counters.prefix_cache_hits) == (0, 0)


def test_a_preempted_sequence_is_readmitted_over_its_own_cached_blocks() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, enable_prefix_cache=True)
    a_prompt, b_prompt = list(range(7)), list(range(20, 28))
    scheduler.add_request(EngineRequest("a", a_prompt, params(max_tokens=3)))
    scheduler.add_request(EngineRequest("b", b_prompt, params(max_tokens=2)))
    results: dict[str, Collected] = {}
    collect(results, step(scheduler, runner))  # a: [0, 1], block 0 cached; b: [2, 3] cached
    collect(results, step(scheduler, runner))  # b's decode needs a 5th block: b yields
    assert scheduler.counters.num_preemptions == 1
    collect(results, step(scheduler, runner))  # a's decode evicts b's cached block 3
    assert runner.steps[2].seqs[0].block_ids == [0, 1, 3]
    assert scheduler.stats().num_evictions == 1
    collect(results, step(scheduler, runner))  # b reuses its cached block 2, evicts block 1
    recompute = runner.steps[3].seqs[0]
    assert (recompute.start_pos, recompute.token_ids) == (4, [24, 25, 26, 27, 28])
    assert recompute.block_ids == [2, 3, 1]
    run(scheduler, runner, {}, results)
    assert (results["a"].tokens, results["b"].tokens) == ({0: [7, 8, 9]}, {0: [28, 29]})
    assert results["b"].num_cached_tokens == 0  # counted at the first admission only
    assert scheduler.counters.num_prefill_tokens == 7 + 8 + 5
    assert scheduler.stats().num_evictions == 2


def test_cache_salt_separates_tenants() -> None:
    scheduler, runner = make_scheduler(enable_prefix_cache=True)
    prompt = list(range(1, 11))
    results: dict[str, Collected] = {}
    for name, salt in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("none", None)):
        request = EngineRequest(name, prompt, params(), cache_salt=salt)
        results = run(scheduler, runner, {0: [request]}, results)
    cached = {name: result.num_cached_tokens for name, result in results.items()}
    assert cached == {"a1": 0, "b1": 0, "a2": 9, "none": 0}


@pytest.mark.parametrize(
    ("policy", "blocker_max_tokens", "first"),
    [
        ("fcfs", 5, "x"),
        ("longest-prefix-first", 5, "y"),  # y's 8 cached tokens put it ahead of x
        ("longest-prefix-first", 40, "x"),  # both waited > LPF_MAX_WAIT_STEPS: queue order
    ],
)
def test_longest_prefix_first_with_an_age_bound(policy, blocker_max_tokens, first) -> None:
    scheduler, runner = make_scheduler(
        max_num_seqs=1, enable_prefix_cache=True, scheduling_policy=policy
    )
    warm = list(range(1, 9))
    results = run(scheduler, runner, {0: [EngineRequest("warm", warm, params(max_tokens=1))]})
    scheduler.add_request(EngineRequest("blocker", [60], params(max_tokens=blocker_max_tokens)))
    step(scheduler, runner)  # the blocker takes the only seat
    scheduler.add_request(EngineRequest("x", [40, 41, 42], params()))
    scheduler.add_request(EngineRequest("y", [*warm, 50], params()))
    results = run(scheduler, runner, {}, results)
    seq_ids = {"x": 2, "y": 3}
    admitted = [s.seq_id for out in runner.steps for s in out.seqs if s.seq_id in (2, 3)]
    assert admitted[0] == seq_ids[first]
    assert results["y"].num_cached_tokens == 8


def test_a_sequence_counts_the_prompt_tokens_the_tree_took_from_it_once() -> None:
    """num_stored_prompt_tokens: new full prompt blocks only; not what a partial copy served,
    not a block stored again after a preemption evicted it."""
    manager = make_manager()

    def run(seq: Sequence) -> None:
        num_tokens = manager.admit(seq, 100)
        if not seq.was_admitted:  # what the scheduler records at the first admission
            seq.num_cached_tokens, seq.was_admitted = seq.num_computed_tokens, True
        manager.slot_mapping(seq, num_tokens)
        seq.num_computed_tokens += num_tokens
        manager.insert_prefix(seq)

    first = make_seq(1, list(range(10)))  # blocks of 4: two full prompt blocks
    run(first)
    assert first.num_stored_prompt_tokens == 8
    second = make_seq(2, [*range(6), 99, 98, 97, 96])  # 4 from block 0, 2 copied from block 1
    run(second)
    assert (second.num_cached_tokens, second.num_stored_prompt_tokens) == (6, 2)
    manager.free(first)
    manager.free(second)
    assert manager.evict(8)  # every cached block goes
    first.reset_for_recompute()
    run(first)  # recomputed after a preemption: stored again, counted once
    assert first.num_stored_prompt_tokens == 8
    manager.check_integrity([first])
