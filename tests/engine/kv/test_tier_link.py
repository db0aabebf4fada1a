"""The second tier under the scheduler, over simulated KV memory (one token id per slot, no
torch): evicted blocks are spilled and loaded back with their exact content (the simulated
runner checks every context it reads against the sequence's tokens), namespaces stay apart, and
every path releases its blocks."""

from __future__ import annotations

import threading

from engine.core.protocol import EngineRequest
from engine.kv.kv_tier import KVTier
from engine.kv.tier_store import MemoryTierStore
from engine.simulation import BLOCK_SIZE, make_scheduler
from tests.engine.fakes import expected_outputs, params, run, step

PROMPT_A = list(range(1, 18))  # four full blocks and one token
PROMPT_B = list(range(30, 58))  # with its outputs, all of an 8-block pool: evicts A's blocks


def tiered(num_blocks: int = 8, **options):
    tier = KVTier(MemoryTierStore(), "fp", BLOCK_SIZE, 1 << 20)
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks, enable_prefix_cache=True, tier=tier, **options
    )
    return scheduler, runner, tier


def serve(scheduler, runner, request_id: str, prompt: list[int], salt: str | None = None):
    request = EngineRequest(request_id, prompt, params(max_tokens=2), cache_salt=salt)
    scheduler.add_request(request)
    result = run(scheduler, runner, {})[request_id]
    assert result.tokens == {0: expected_outputs(prompt, 0, 2)}
    assert scheduler.num_leaked_blocks() == 0
    return result


def test_evicted_blocks_come_back_from_the_tier_with_their_exact_content() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B)
    assert scheduler.kv_cache_manager.num_evictions > 0
    assert tier.contains(("w0", "", ""), PROMPT_A[:BLOCK_SIZE])
    again = serve(scheduler, runner, "a2", PROMPT_A)
    assert again.num_cached_tokens == 16  # every full block; the last token is computed
    assert scheduler.counters.prefix_cache_tier_hits == 16
    loads = [load for out in runner.steps for load in out.block_loads]
    assert len(loads) == 4
    # The loaded blocks are cached read-only in the pool again: a third run hits the pool.
    hits_before = scheduler.counters.prefix_cache_tier_hits
    assert serve(scheduler, runner, "a3", PROMPT_A).num_cached_tokens == 16
    assert scheduler.counters.prefix_cache_tier_hits == hits_before


def test_the_tier_continues_a_partial_pool_match() -> None:
    scheduler, runner, _tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B[:20])  # evicts A's tail blocks only
    kv = scheduler.kv_cache_manager
    pool_blocks = kv.prefix_cache.match(("w0", "", ""), PROMPT_A).full_block_ids
    assert 0 < len(pool_blocks) < 4  # the head still in the pool, the rest in the tier only
    again = serve(scheduler, runner, "a2", PROMPT_A)
    assert again.num_cached_tokens == 16
    assert scheduler.counters.prefix_cache_tier_hits == (4 - len(pool_blocks)) * BLOCK_SIZE


def test_a_salt_or_tenant_never_loads_another_namespaces_tier_blocks() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A, salt="tenant-1")
    serve(scheduler, runner, "b", PROMPT_B, salt="tenant-1")
    assert tier.num_entries_in(("w0", "", "tenant-1")) > 0
    other = serve(scheduler, runner, "a2", PROMPT_A, salt="tenant-2")
    assert other.num_cached_tokens == 0
    assert scheduler.counters.prefix_cache_tier_hits == 0
    same = serve(scheduler, runner, "a3", PROMPT_A, salt="tenant-1")
    assert same.num_cached_tokens == 16


def test_an_abort_while_the_rest_of_a_restored_prompt_computes_leaks_nothing() -> None:
    scheduler, runner, _tier = tiered(num_blocks=12, max_num_batched_tokens=4)
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", [*PROMPT_B, *range(60, 72)])
    longer = [*PROMPT_A[:16], *range(100, 112)]
    scheduler.add_request(EngineRequest("a2", longer, params(max_tokens=2)))
    step(scheduler, runner)
    assert runner.steps[-1].block_loads  # restored, and its suffix is computing
    scheduler.abort_request("a2")
    step(scheduler, runner)
    assert scheduler.num_leaked_blocks() == 0
    assert serve(scheduler, runner, "a3", PROMPT_A).num_cached_tokens == 16


def test_a_failed_step_loses_its_spills_and_nothing_else() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    scheduler.add_request(EngineRequest("b", PROMPT_B, params(max_tokens=2)))
    out = scheduler.schedule()
    assert out.block_spills
    num_entries = tier.num_entries
    scheduler.kv_cache_manager.store_spilled(out.block_spills, [])  # the runner never ran
    scheduler.fail_seqs([s.seq_id for s in out.seqs], "engine fault")
    scheduler.check_integrity()
    assert scheduler.num_leaked_blocks() == 0
    assert tier.num_entries == num_entries
    assert scheduler.kv_cache_manager.tier_link.num_spills_lost == len(out.block_spills)
    serve(scheduler, runner, "a2", PROMPT_A)  # computed again, correctly


def test_a_quarantined_block_never_comes_back_from_the_tier() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B)
    serve(scheduler, runner, "a2", PROMPT_A)  # loaded back: in the pool and in the tier
    kv = scheduler.kv_cache_manager
    blocks = kv.prefix_cache.match(("w0", "", ""), PROMPT_A).full_block_ids
    assert tier.match(("w0", "", ""), PROMPT_A, 0, 4) == 4
    kv.quarantine([blocks[1]])
    assert tier.match(("w0", "", ""), PROMPT_A, 0, 4) == 1  # block 0 only
    again = serve(scheduler, runner, "a3", PROMPT_A)
    assert again.num_cached_tokens == BLOCK_SIZE


def test_blocks_evicted_for_another_holder_are_spilled_for_it_to_read() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    kv = scheduler.kv_cache_manager
    held = kv.allocate_held_blocks("audit-0", kv.num_total_blocks * BLOCK_SIZE)
    assert held is not None and kv.num_evictions > 0
    spills = kv.take_block_spills()  # the auditor reads them before it writes its blocks
    assert [spill.token_ids for spill in spills][-1] == tuple(PROMPT_A[:BLOCK_SIZE])
    kv.store_spilled(spills, [runner.block_bytes(spill.block_id) for spill in spills])
    kv.release_blocks("audit-0")
    assert serve(scheduler, runner, "a2", PROMPT_A).num_cached_tokens == 16
    assert tier.counters.num_loaded_blocks == len(spills)


def test_a_partial_pool_match_does_not_keep_the_tier_from_loading() -> None:
    """The pool matches block 0 and one token of another prompt's block 1, whose node is
    locked for that partial block: the tier's blocks 1.. still find room to load."""
    scheduler, runner, tier = tiered(num_blocks=12)
    shared = [1, 2, 3, 4]
    prompt_b = [*shared, 10, 20, 21, 22, *range(23, 39), 99]  # 6 full blocks
    prompt_a = [*shared, 10, 11, 12, 13, *range(40, 72), 98]  # 10 full blocks, one node
    serve(scheduler, runner, "b1", prompt_b)
    serve(scheduler, runner, "f", list(range(200, 244)))  # b's blocks go to the tier
    serve(scheduler, runner, "a", prompt_a)
    assert tier.contains(("w0", "", ""), prompt_b[:24])
    tier_hits = scheduler.counters.prefix_cache_tier_hits
    again = serve(scheduler, runner, "b2", prompt_b)
    assert again.num_cached_tokens == 24  # block 0 from the pool, 1..5 from the tier
    assert scheduler.counters.prefix_cache_tier_hits - tier_hits == 20


def test_blocks_whose_load_never_ran_are_not_served_from_the_pool() -> None:
    scheduler, runner, tier = tiered()
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B)
    scheduler.add_request(EngineRequest("a2", PROMPT_A, params(max_tokens=2)))
    out = scheduler.schedule()
    assert out.block_loads
    kv = scheduler.kv_cache_manager
    kv.store_spilled(out.block_spills, [])  # the step failed: LLMEngine.step's fault path
    kv.drop_unwritten(out.block_loads)
    scheduler.fail_seqs([s.seq_id for s in out.seqs], "engine fault")
    scheduler.check_integrity()
    assert kv.prefix_cache.match(("w0", "", ""), PROMPT_A).num_matched_tokens == 0
    # Loaded again from the tier, which still holds the right bytes (the runner checks them).
    assert serve(scheduler, runner, "a3", PROMPT_A).num_cached_tokens == 16
    assert tier.counters.num_loaded_blocks == 8


def test_a_pool_short_of_room_loads_the_blocks_that_fit_and_computes_the_rest() -> None:
    scheduler, runner, _tier = tiered(num_blocks=8, max_num_batched_tokens=4)
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B)
    kv = scheduler.kv_cache_manager
    held = kv.allocate_held_blocks("holder", 5 * BLOCK_SIZE)  # 3 blocks left to admit A
    assert held is not None
    scheduler.add_request(EngineRequest("a2", PROMPT_A, params(max_tokens=2)))
    step(scheduler, runner)
    assert len(runner.steps[-1].block_loads) == 2  # two loaded, a chunk's block beside them
    kv.release_blocks("holder")
    result = run(scheduler, runner, {})["a2"]
    assert result.num_cached_tokens == 2 * BLOCK_SIZE
    assert result.tokens == {0: expected_outputs(PROMPT_A, 0, 2)}
    assert scheduler.num_leaked_blocks() == 0


class GatedStore(MemoryTierStore):
    """A store whose reads wait until the test opens the gate (a slow disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def get(self, key: str) -> bytes | None:
        assert self.gate.wait(timeout=10), "the gate stayed shut"
        return super().get(key)


def read_ahead_with_a_in_the_tier():
    """A scheduler whose tier reads on a reader thread through a gated store, A's blocks in
    the tier only, and the gate shut (reads hang until the test opens it)."""
    store = GatedStore()
    tier = KVTier(store, "fp", BLOCK_SIZE, 1 << 20, read_ahead=True)
    scheduler, runner = make_scheduler(num_blocks=8, enable_prefix_cache=True, tier=tier)
    serve(scheduler, runner, "a1", PROMPT_A)
    serve(scheduler, runner, "b", PROMPT_B)
    store.gate.clear()
    return scheduler, runner, store, scheduler.kv_cache_manager


def test_with_read_ahead_a_request_waits_for_its_reads_while_others_step() -> None:
    scheduler, runner, store, kv = read_ahead_with_a_in_the_tier()
    scheduler.add_request(EngineRequest("a2", PROMPT_A, params(max_tokens=2)))
    scheduler.add_request(EngineRequest("x", [60, 61, 62], params(max_tokens=2)))
    step(scheduler, runner)
    scheduled = [s.seq_id for s in runner.steps[-1].seqs]
    assert len(scheduled) == 1 and not runner.steps[-1].block_loads  # x runs, a2 waits
    assert kv.tier_link.num_reads_in_flight == 1
    store.gate.set()
    kv.wait_for_tier_reads(10.0)
    results = run(scheduler, runner, {})
    assert results["a2"].num_cached_tokens == 16
    assert results["a2"].tokens == {0: expected_outputs(PROMPT_A, 0, 2)}
    assert scheduler.num_leaked_blocks() == 0
    kv.tier_link.close()


def test_with_read_ahead_an_abort_while_reading_leaves_nothing() -> None:
    scheduler, runner, store, kv = read_ahead_with_a_in_the_tier()
    scheduler.add_request(EngineRequest("a2", PROMPT_A, params(max_tokens=2)))
    step(scheduler, runner)
    assert kv.tier_link.num_reads_in_flight == 1
    scheduler.abort_request("a2")
    assert kv.tier_link.num_reads_in_flight == 0  # its read is forgotten with it
    store.gate.set()
    step(scheduler, runner)
    assert scheduler.num_leaked_blocks() == 0 and not scheduler.has_unfinished_requests()
    assert serve(scheduler, runner, "a3", PROMPT_A).num_cached_tokens == 16
    kv.tier_link.close()
