"""Fair share between tenants (VTC) and request priority in the scheduler: exact admission
order, counter lifts, priority preemption with exact block ids (no torch)."""

from __future__ import annotations

import pytest

from engine.core.fair_share import FairShare, FairShareWeights
from engine.core.protocol import EngineRequest
from engine.core.scheduler import Scheduler
from tests.engine.fakes import Collected, FakeRunner, collect, make_scheduler, params, run, step


def request(request_id: str, prompt: list[int], tenant: str | None = None, **kwargs):
    priority = kwargs.pop("priority", 0)
    return EngineRequest(request_id, prompt, params(**kwargs), tenant=tenant, priority=priority)


def admission_order(runner: FakeRunner, scheduler: Scheduler) -> list[str]:
    """Request ids in the order their first chunk was scheduled."""
    order: list[str] = []
    for out in runner.steps:
        for scheduled in out.seqs:
            request_id = seq_requests(scheduler)[scheduled.seq_id]
            if request_id not in order:
                order.append(request_id)
    return order


def seq_requests(scheduler: Scheduler) -> dict[int, str]:
    return scheduler._seq_request_ids  # filled by the recording wrapper below


def recording(scheduler: Scheduler) -> Scheduler:
    """Keep every seq id -> request id the scheduler ever made (finished seqs are dropped)."""
    scheduler._seq_request_ids = {}
    add = scheduler.table.add

    def add_and_record(req) -> None:
        add(req)
        for seq in req.sequences:
            scheduler._seq_request_ids[seq.seq_id] = seq.request_id

    scheduler.table.add = add_and_record
    return scheduler


def one_at_a_time(policy: str) -> tuple[Scheduler, FakeRunner]:
    scheduler, runner = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    return recording(scheduler), runner


def flood_and_trickle() -> list[EngineRequest]:
    """Tenant A queues four 8-token prompts, then tenant B two: all before the first step."""
    a = [request(f"a{i}", list(range(10 * i + 1, 10 * i + 9)), "A", max_tokens=2) for i in range(4)]
    b = [request(f"b{i}", list(range(50 + 4 * i, 54 + 4 * i)), "B", max_tokens=2) for i in range(2)]
    return a + b


def test_fcfs_serves_the_flood_first() -> None:
    scheduler, runner = one_at_a_time("fcfs")
    run(scheduler, runner, {0: flood_and_trickle()})
    assert admission_order(runner, scheduler) == ["a0", "a1", "a2", "a3", "b0", "b1"]


def test_fair_share_admits_the_least_served_tenant_first() -> None:
    # Service: prompt tokens x1, output tokens x2. A and B start level, a tie goes to the
    # earlier in the queue: a0 (A = 8 + 2 * 2 = 12), then b0 (B = 4 + 4 = 8), b1 (B = 16),
    # then a1 (A = 24), a2, a3.
    scheduler, runner = one_at_a_time("fair-share")
    run(scheduler, runner, {0: flood_and_trickle()})
    assert admission_order(runner, scheduler) == ["a0", "b0", "b1", "a1", "a2", "a3"]
    assert scheduler.fair_share.counters == {"A": 48.0, "B": 16.0}
    assert scheduler.num_leaked_blocks() == 0


def test_a_newly_active_tenant_is_lifted_to_the_least_active_counter() -> None:
    scheduler, runner = one_at_a_time("fair-share")
    a = [request(f"a{i}", list(range(10 * i + 1, 10 * i + 9)), "A", max_tokens=2) for i in range(3)]
    for req in a:
        scheduler.add_request(req)
    for _ in range(2):  # a0 prefills, decodes, finishes: A = 8 + 2 * 2
        step(scheduler, runner)
    assert scheduler.fair_share.counter("A") == 12.0
    scheduler.add_request(request("b0", [60, 61, 62, 63], "B", max_tokens=2))
    assert scheduler.fair_share.counter("B") == 12.0  # not 0: no credit banked while idle
    run(scheduler, runner, {})
    assert admission_order(runner, scheduler) == ["a0", "a1", "b0", "a2"]


def test_lift_and_forgetting_on_the_counters_alone() -> None:
    fair = FairShare(FairShareWeights(prompt=1.0, cached_prompt=0.5, output=2.0))
    fair.activate("A", [])
    fair.charge_prompt("A", 10, num_cached=4)  # 10 + 2
    fair.activate("B", ["A"])
    fair.charge_output("B", 20)  # lifted to 12, then 40 more
    fair.activate("C", ["A", "B"])
    assert fair.counters == {"A": 12.0, "B": 52.0, "C": 12.0}
    fair.activate("A", ["B", "C"])  # A came back while B and C ran: keeps its own 12
    assert fair.counters == {"A": 12.0, "B": 52.0, "C": 12.0}
    fair.activate("D", ["B"])  # A and C are idle at or below B's 52: forgotten
    assert fair.counters == {"B": 52.0, "D": 52.0}
    assert fair.spread() == 0.0
    fair.activate("E", [])  # nobody active: everyone starts level
    assert fair.counters == {"E": 0.0}


NUM_BLOCKS = 8  # small enough that the workload preempts


def test_one_tenant_fair_share_steps_exactly_like_fcfs() -> None:
    def workload() -> dict[int, list[EngineRequest]]:
        shared = list(range(1, 13))
        return {
            0: [request(f"r{i}", shared + [20 + i] * (i + 1), max_tokens=3 + i) for i in range(5)],
            2: [request("late", [*shared, 40, 41], max_tokens=6)],
            4: [request(f"p{i}", list(range(30, 41 + i)), priority=i % 2) for i in range(3)],
        }

    steps = {}
    for policy in ("fcfs", "fair-share"):
        scheduler, runner = make_scheduler(
            num_blocks=NUM_BLOCKS,
            max_num_seqs=4,
            max_num_batched_tokens=10,
            enable_prefix_cache=True,
            scheduling_policy=policy,
        )
        run(scheduler, runner, workload())
        steps[policy] = [
            (
                [(s.seq_id, s.token_ids, s.block_ids, s.start_pos) for s in out.seqs],
                out.slot_mapping,
                out.block_copies,
            )
            for out in runner.steps
        ]
        assert scheduler.counters.num_preemptions > 0  # the workload does preempt
    assert steps["fcfs"] == steps["fair-share"]


# -- priority ------------------------------------------------------------------------------
def test_priority_orders_within_a_tenant_lower_first_then_arrival() -> None:
    scheduler, runner = one_at_a_time("fair-share")
    arrivals = [
        request("p5", [1, 2, 3], "A", priority=5, max_tokens=1),
        request("p0", [4, 5, 6], "A", max_tokens=1),
        request("m1", [7, 8, 9], "A", priority=-1, max_tokens=1),
        request("q0", [10, 11, 12], "A", max_tokens=1),
    ]
    run(scheduler, runner, {0: arrivals})
    assert admission_order(runner, scheduler) == ["m1", "p0", "q0", "p5"]


def test_fcfs_honours_priority_too() -> None:
    scheduler, runner = one_at_a_time("fcfs")
    arrivals = [
        request("late", [1, 2, 3], priority=3, max_tokens=1),
        request("urgent", [4, 5, 6], priority=-3, max_tokens=1),
    ]
    run(scheduler, runner, {0: arrivals})
    assert admission_order(runner, scheduler) == ["urgent", "late"]


def test_out_of_blocks_preempts_the_lowest_priority_not_the_newest() -> None:
    # 4 blocks of 4 tokens. "low" (priority 1) is admitted first, "high" (priority 0) a step
    # later; at step 5 low needs a third block and none is free: low, the lowest priority,
    # is preempted (under the old rule high, the newest, would have been).
    scheduler, runner = make_scheduler(num_blocks=4, scheduling_policy="fair-share")
    low = request("low", [1, 2, 3, 4], priority=1, max_tokens=8)
    high = request("high", [11, 12, 13, 14], max_tokens=8)
    results: dict[str, Collected] = {}
    scheduler.add_request(low)
    collect(results, step(scheduler, runner))
    scheduler.add_request(high)
    for _ in range(4):
        collect(results, step(scheduler, runner))
    tables = {s.seq_id: s.block_ids for s in runner.steps[-1].seqs}
    assert tables == {0: [0, 1], 1: [2, 3]}
    collect(results, step(scheduler, runner))
    assert scheduler.counters.num_preemptions == 1
    assert [(s.seq_id, s.block_ids) for s in runner.steps[-1].seqs] == [(1, [2, 3])]
    assert scheduler.get_seq(0).block_ids == [] and scheduler.num_waiting == 1
    collect(
        results, step(scheduler, runner)
    )  # high's 9th token opens a block: block 0, which low freed
    assert [(s.seq_id, s.block_ids) for s in runner.steps[-1].seqs] == [(1, [2, 3, 0])]
    run(scheduler, runner, {}, results)
    assert results["low"].tokens == {0: list(range(5, 13))}
    assert results["high"].tokens == {0: list(range(15, 23))}


@pytest.mark.parametrize(
    ("policy", "expected", "first_steps"),
    [
        ("fcfs", ["a0", "a1", "b0"], [["a0"], ["a0"], ["a0", "a1", "b0"]]),
        ("fair-share", ["a0", "b0", "a1"], [["a0"], ["b0", "a0"], ["b0", "a0"]]),
    ],
)
def test_fair_share_composes_with_the_prefix_cache_and_chunked_prefill(
    policy, expected, first_steps
) -> None:
    # 8 tokens a step. a0 (17 tokens) prefills in chunks, inserting its full blocks after each;
    # a1 shares its 16-token prefix. fcfs: a0 takes 8, 8, then 1 and a1 (16 cached) and b0 the
    # rest. Fair share: in step 2 B (0) is less served than A (8), whose prefill is running, so
    # b0 (6 tokens) goes before a0's next chunk (2 tokens); a1 follows, its prefix cached.
    scheduler, runner = make_scheduler(
        max_num_batched_tokens=8, enable_prefix_cache=True, scheduling_policy=policy
    )
    recording(scheduler)
    prefix = list(range(1, 17))
    arrivals = [
        request("a0", [*prefix, 40], "A", max_tokens=2),
        request("a1", [*prefix, 41], "A", max_tokens=2),
        request("b0", [50, 51, 52, 53, 54, 55], "B", max_tokens=2),
    ]
    results = run(scheduler, runner, {0: arrivals})
    assert admission_order(runner, scheduler) == expected
    names = seq_requests(scheduler)
    assert [[names[s.seq_id] for s in out.seqs] for out in runner.steps[:3]] == first_steps
    assert results["a1"].num_cached_tokens == 16
