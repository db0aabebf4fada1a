"""Which running sequence a preemption takes when tenants share the KV pool: priority orders a
tenant's own sequences only, and a tenant within its fair share of the pool never loses one to
another tenant's priority (no torch; exact seq and block ids)."""

from __future__ import annotations

from engine.core.protocol import EngineRequest
from engine.sched.scheduler import Scheduler
from engine.simulation import SimulatedRunner, make_scheduler
from tests.engine.fakes import Collected, collect, params, run, step


def request(request_id: str, prompt: list[int], tenant: str, priority: int = 0, **kwargs):
    return EngineRequest(request_id, prompt, params(**kwargs), tenant=tenant, priority=priority)


def tables(runner: SimulatedRunner) -> list[tuple[int, list[int]]]:
    """The last step's scheduled sequences: (seq id, block table), in step order."""
    return [(s.seq_id, s.block_ids) for s in runner.steps[-1].seqs]


Scenario = tuple[Scheduler, SimulatedRunner, dict[str, Collected]]


def urgent_tenant_beside_a_small_one(policy: str) -> Scenario:
    """6 blocks of 4 tokens: a fair share is 3 blocks each. A's a0 (priority -10, seq 0)
    runs, B's b0 (priority 0, seq 1) joins, then A's a1 (priority -5, seq 2). After step 5 A
    holds 4 blocks, B 2, none is free, and a0's 13th token opens a block."""
    scheduler, runner = make_scheduler(num_blocks=6, scheduling_policy=policy)
    results: dict[str, Collected] = {}
    arrivals = [
        request("a0", list(range(1, 9)), "A", priority=-10, max_tokens=10),
        request("b0", [21, 22, 23, 24], "B", max_tokens=6),
        request("a1", [41, 42], "A", priority=-5, max_tokens=6),
    ]
    for index in range(5):
        if index < len(arrivals):
            scheduler.add_request(arrivals[index])
        collect(results, step(scheduler, runner))
    assert dict(tables(runner)) == {0: [0, 1, 2], 1: [3, 4], 2: [5]}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, runner, results


def test_a_tenant_over_its_share_preempts_its_own_request_not_a_smaller_tenants() -> None:
    # Step 6: A holds 4 of 6 blocks (over its 3), B 2. A's priorities (-10, -5) are below
    # B's 0, yet b0 keeps its blocks: the victim is A's own lowest priority, a1, whose block
    # 5 a0 takes. B's decode goes first while A is over its share.
    scheduler, runner, _ = urgent_tenant_beside_a_small_one("fair-share")
    step(scheduler, runner)
    assert scheduler.counters.num_preemptions == 1
    assert tables(runner) == [(1, [3, 4]), (0, [0, 1, 2, 5])]
    assert [seq.request_id for seq in scheduler.table.waiting] == ["a1"]


def test_a_tenant_within_its_share_loses_blocks_only_to_its_own_growth() -> None:
    # Step 7: b0's 9th token opens a block and none is free. A (a0's 4 blocks) is still over
    # its share: a0 yields, though it is A's most urgent request and B's priority is the
    # lowest. b0 takes a0's block 0. Nothing of B is ever preempted; every output is intact.
    scheduler, runner, results = urgent_tenant_beside_a_small_one("fair-share")
    for _ in range(2):
        collect(results, step(scheduler, runner))
    assert scheduler.counters.num_preemptions == 2
    assert tables(runner) == [(1, [3, 4, 0])]
    assert [seq.request_id for seq in scheduler.table.waiting] == ["a0", "a1"]
    run(scheduler, runner, {}, results)
    assert scheduler.counters.num_preemptions == 2
    assert results["a0"].tokens == {0: list(range(9, 19))}
    assert results["a1"].tokens == {0: list(range(43, 49))}
    assert results["b0"].tokens == {0: list(range(25, 31))}


def test_fcfs_preempts_by_priority_across_tenants() -> None:
    # fcfs orders the whole queue by priority: b0, the highest value, yields to a0.
    scheduler, runner, _ = urgent_tenant_beside_a_small_one("fcfs")
    step(scheduler, runner)
    assert scheduler.counters.num_preemptions == 1
    assert tables(runner) == [(0, [0, 1, 2, 3]), (2, [5, 4])]
    assert [seq.request_id for seq in scheduler.table.waiting] == ["b0"]


def test_with_no_tenant_over_its_share_the_requesting_tenant_yields() -> None:
    # 6 blocks, three tenants, 2 blocks each: nobody is over its share. a0's 9th token opens
    # a block: B's b0 (priority 5, the highest value) and C's c0 (the newest) keep theirs;
    # a0, its tenant's only request, gives up its own blocks.
    scheduler, runner = make_scheduler(num_blocks=6, scheduling_policy="fair-share")
    scheduler.add_request(request("a0", list(range(1, 7)), "A", max_tokens=4))
    step(scheduler, runner)
    scheduler.add_request(request("b0", list(range(11, 17)), "B", priority=5, max_tokens=4))
    step(scheduler, runner)
    scheduler.add_request(request("c0", list(range(21, 27)), "C", max_tokens=4))
    step(scheduler, runner)
    assert tables(runner) == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])]
    step(scheduler, runner)
    assert scheduler.counters.num_preemptions == 1
    assert tables(runner) == [(1, [2, 3]), (2, [4, 5])]
    assert [seq.request_id for seq in scheduler.table.waiting] == ["a0"]
    run(scheduler, runner, {})
