"""Fair share between tenants (VTC) and request priority in the scheduler: exact admission
order, counter lifts, priority preemption with exact block ids (no torch)."""

from __future__ import annotations

import pytest

from engine.core.protocol import EngineRequest
from engine.sched.fair_share import ActiveTenants, FairShare, FairShareWeights
from engine.sched.scheduler import Scheduler
from engine.simulation import SimulatedRunner, make_scheduler
from tests.engine.fakes import Collected, collect, params, run, step


def request(request_id: str, prompt: list[int], tenant: str | None = None, **kwargs):
    priority = kwargs.pop("priority", 0)
    return EngineRequest(request_id, prompt, params(**kwargs), tenant=tenant, priority=priority)


def admission_order(runner: SimulatedRunner, scheduler: Scheduler) -> list[str]:
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


def one_at_a_time(policy: str) -> tuple[Scheduler, SimulatedRunner]:
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


STEP_SECONDS = 0.25  # exact in binary, so the active window ends on a step boundary


class StepClock:
    """Step k (from 1) runs from (k - 1) * STEP_SECONDS to k * STEP_SECONDS: the time is the
    fake runner's step count, so schedule() reads a step's start and update_from_output its
    end; plus idle_seconds, the time the engine spent without a step."""

    def __init__(self) -> None:
        self.runner: SimulatedRunner | None = None
        self.idle_seconds = 0.0

    def __call__(self) -> float:
        return STEP_SECONDS * len(self.runner.steps) + self.idle_seconds


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
    for name, policy, cap in (
        ("fcfs", "fcfs", 0),
        ("fair-share", "fair-share", 0),
        ("fair-share with a cap", "fair-share", 1),  # one active tenant: the cap never applies
    ):
        clock = StepClock()
        scheduler, runner = make_scheduler(
            num_blocks=NUM_BLOCKS,
            max_num_seqs=4,
            max_num_batched_tokens=10,
            enable_prefix_cache=True,
            scheduling_policy=policy,
            fair_share_prefill_tokens=cap,
            clock=clock,
        )
        clock.runner = runner
        run(scheduler, runner, workload())
        steps[name] = [
            (
                [(s.seq_id, s.token_ids, s.block_ids, s.start_pos) for s in out.seqs],
                out.slot_mapping,
                out.block_copies,
            )
            for out in runner.steps
        ]
        assert scheduler.counters.num_preemptions > 0  # the workload does preempt
    assert steps["fcfs"] == steps["fair-share"] == steps["fair-share with a cap"]


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


# -- the prefill cap and the tie at activation -----------------------------------------------
def capped(fair_share_prefill_tokens: int) -> tuple[Scheduler, SimulatedRunner]:
    """Fair share, 64 tokens a step, an active window of 1 s (4 steps)."""
    clock = StepClock()
    scheduler, runner = make_scheduler(
        num_blocks=256,
        max_num_batched_tokens=64,
        max_model_len=512,
        scheduling_policy="fair-share",
        fair_share_prefill_tokens=fair_share_prefill_tokens,
        fair_share_active_seconds=1.0,
        clock=clock,
    )
    clock.runner = runner
    return recording(scheduler), runner


def prefill_chunks(
    scheduler: Scheduler, runner: SimulatedRunner, prompts: dict[str, list[int]]
) -> list[list[tuple[str, int]]]:
    """Each step's prefill chunks, in step order: (request id, prompt tokens computed)."""
    names = seq_requests(scheduler)
    steps = []
    for out in runner.steps:
        chunks = []
        for scheduled in out.seqs:
            request_id = names[scheduled.seq_id]
            end = min(scheduled.context_len, len(prompts[request_id]))
            if end > scheduled.start_pos:  # a decode starts past the prompt
                chunks.append((request_id, end - scheduled.start_pos))
        steps.append(chunks)
    return steps


def a_visitor_during_a_flood() -> tuple[Scheduler, SimulatedRunner, list[list[tuple[str, int]]]]:
    """A queues a 300-token and a 40-token prompt; before step 2, B sends 4 tokens (2 out).
    Cap 16. B's request ends with step 3 (t = 0.75 s), so B stays active through step 7
    (t = 1.5) and is not any more at step 8 (t = 1.75: 1 s after)."""
    scheduler, runner = capped(16)
    prompts = {
        "a0": list(range(1000, 1300)),
        "a1": list(range(2000, 2040)),
        "b0": [60, 61, 62, 63],
    }
    arrivals = {
        0: [request(name, prompts[name], "A", max_tokens=2) for name in ("a0", "a1")],
        1: [request("b0", prompts["b0"], "B", max_tokens=2)],
    }
    run(scheduler, runner, arrivals)  # also: every request ends, no block leaked
    return scheduler, runner, prefill_chunks(scheduler, runner, prompts)


def test_a_tenant_arriving_during_a_long_prefill_gets_the_next_step_to_itself() -> None:
    # Step 1: A alone, its full budget. Step 2: B (lifted to A's 64, a tie, and no prefill
    # running) is favoured and its request waits for its first chunk: the step is B's whole
    # prompt and its first token, alone (A's chunk waits one step; without that, A would get
    # what is left of the cap, 16 - 4 = 12 tokens), and no spare tokens for audits.
    scheduler, runner, steps = a_visitor_during_a_flood()
    assert steps[:2] == [[("a0", 64)], [("b0", 4)]]
    (b0,) = runner.steps[1].seqs
    assert seq_requests(scheduler)[b0.seq_id] == "b0"
    assert b0.sample is not None and b0.sample.output_index == 0
    assert runner.steps[1].num_spare_tokens == 0


def test_while_another_tenant_is_active_a_steps_prefill_stays_under_the_cap() -> None:
    # Step 3: B decodes its last token (decodes are never capped); B has 64 + 4 + 2 = 70
    # against A's 64, so A is favoured: its chunk is the rest of the budget, 63. Steps 4-7: B
    # has no request but ended less than 1 s ago and is the least served (B 72 against A's
    # 127 and up): A's prefill stays at 16 a step. Audits get no spare tokens past the cap.
    _, runner, steps = a_visitor_during_a_flood()
    assert steps[2:7] == [[("a0", 63)]] + [[("a0", 16)]] * 4
    assert [out.num_decodes for out in runner.steps[1:4]] == [0, 1, 0]
    assert [out.num_spare_tokens for out in runner.steps[1:7]] == [0] * 6


def test_after_the_active_window_the_flood_gets_the_full_budget_again() -> None:
    # Step 8, 1 s after B's request ended: A is the only active tenant, no cap. a0 has 300 -
    # 191 tokens left: 64, then its last 45 and 19 of a1's 40, then a0's first decode and
    # a1's last 21 (42 spare).
    _, runner, steps = a_visitor_during_a_flood()
    assert steps[7:10] == [[("a0", 64)], [("a0", 45), ("a1", 19)], [("a1", 21)]]
    assert runner.steps[9].num_spare_tokens == 42


def test_a_first_chunk_alone_defers_the_others_one_step_never_two_in_a_row() -> None:
    # A decodes a0 and prefills a1. Before step 4, B and C each send a prompt, both lifted
    # to A's counter; B and C have no prefill running, so the first live of them, B, is
    # favoured: step 4 is b0's prompt alone (a0's decode and a1's chunk wait). Step 5 may not
    # be anyone's alone: a0 decodes with b0, and C (now the least served, tied with A) has
    # c0 admitted with its whole prompt, A's chunk the rest of the cap (16 - 5).
    scheduler, runner = capped(16)
    prompts = {
        "a0": list(range(1000, 1010)),
        "a1": list(range(2000, 2300)),
        "b0": [60, 61, 62],
        "c0": [70, 71, 72, 73, 74],
    }
    arrivals = {
        0: [request("a0", prompts["a0"], "A", max_tokens=8)],
        1: [request("a1", prompts["a1"], "A", max_tokens=2)],
        3: [request(name, prompts[name], name[0].upper(), max_tokens=2) for name in ("b0", "c0")],
    }
    run(scheduler, runner, arrivals)  # also: every request ends, no block leaked
    names = seq_requests(scheduler)
    chunks = [[(names[s.seq_id], len(s.token_ids)) for s in out.seqs] for out in runner.steps]
    assert chunks[2:6] == [
        [("a0", 1), ("a1", 63)],
        [("b0", 3)],
        [("a0", 1), ("b0", 1), ("c0", 5), ("a1", 11)],
        [("a0", 1), ("c0", 1), ("a1", 16)],
    ]
    assert [out.num_decodes for out in runner.steps[2:6]] == [1, 0, 2, 2]


def test_a_tie_at_activation_admits_the_new_tenant_before_the_running_chunk() -> None:
    # No cap: the tie rule alone. After step 1 A has 64 and B is lifted to 64. B has no
    # prefill running, so it is admitted ahead of a0's chunk; A's own a1, at the same counter,
    # never jumps a0 (with a1 first, a0 would get 40).
    scheduler, runner = capped(0)
    prompts = {"a0": list(range(1000, 1300)), "a1": list(range(2000, 2020)), "b0": [60, 61]}
    for name in ("a0", "a1"):
        scheduler.add_request(request(name, prompts[name], "A", max_tokens=2))
    step(scheduler, runner)
    scheduler.add_request(request("b0", prompts["b0"], "B", max_tokens=2))
    assert scheduler.fair_share.counter("B") == scheduler.fair_share.counter("A") == 64.0
    run(scheduler, runner, {})
    steps = prefill_chunks(scheduler, runner, prompts)
    assert steps[:2] == [[("a0", 64)], [("b0", 2), ("a0", 62)]]


def test_the_cap_never_throttles_the_least_served_of_two_floods() -> None:
    # A and B both prefill 300-token prompts: each step is the less served tenant's full chunk
    # and none of the other's (the cap is used up), so no step is short. Ties: the tenant
    # with no prefill running (step 2), then the older live request (steps 4 and 6).
    scheduler, runner = capped(16)
    prompts = {"a0": list(range(1000, 1300)), "b0": list(range(2000, 2300))}
    arrivals = {
        0: [request("a0", prompts["a0"], "A", max_tokens=2)],
        1: [request("b0", prompts["b0"], "B", max_tokens=2)],
    }
    run(scheduler, runner, arrivals)
    steps = prefill_chunks(scheduler, runner, prompts)
    a, b = [("a0", 64)], [("b0", 64)]
    assert steps[:7] == [a, b, a, a, b, a, b]


@pytest.mark.parametrize("how", ["finished", "aborted"])
def test_a_request_ends_when_it_finishes_or_is_aborted_not_at_the_next_step(how) -> None:
    # B's request ends, then the engine idles 10 s, then A floods: B is not active any more
    # (counted from the next step, B would be, and the least served: A capped at step 2).
    scheduler, runner = capped(16)
    scheduler.add_request(request("b0", [60, 61, 62, 63], "B", max_tokens=2))
    step(scheduler, runner)
    if how == "aborted":
        scheduler.abort_request("b0")
    else:
        step(scheduler, runner)
    assert not scheduler.has_unfinished_requests()
    scheduler.fair_share.clock.idle_seconds = 10.0
    prompts = {"b0": [60, 61, 62, 63], "a0": list(range(1000, 1300))}
    run(scheduler, runner, {0: [request("a0", prompts["a0"], "A", max_tokens=2)]})
    steps = prefill_chunks(scheduler, runner, prompts)
    assert [chunks for chunks in steps if chunks and chunks[0][0] == "a0"] == [
        [("a0", 64)],
        [("a0", 64)],
        [("a0", 64)],
        [("a0", 64)],
        [("a0", 44)],
    ]


def test_active_tenants_stay_active_for_the_window_after_their_last_request() -> None:
    active = ActiveTenants(window_seconds=1.0)
    assert active.observe(["A", "B", "A"], 0.0) == ["A", "B"]
    assert active.observe(["A"], 0.5) == ["A", "B"]  # B is found without a request: ends at 0.5
    assert active.observe(["A"], 1.25) == ["A", "B"]
    assert active.observe(["A"], 1.5) == ["A"]
    assert active.observe([], 10.0) == ["A"]  # A ended at 10.0 (observed after every end)
    assert active.observe(["C"], 10.75) == ["C", "A"]
    assert active.observe(["C"], 11.0) == ["C"]
    assert ActiveTenants(window_seconds=0.0).observe(["A"], 0.0) == ["A"]
