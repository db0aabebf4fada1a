"""The scheduler's own time per step under each policy, with no model (torch-free).

    PYTHONPATH=. python benchmarks/scheduler_cost.py [--rounds 15] [--requests 32] [--concurrency 8]

The real Scheduler and KVCacheManager with the simulated runner of engine/simulation.py: one
tenant's requests (a shared 199-token prefix, then 40 tokens of their own, 32 output tokens),
at most --concurrency of them in the scheduler at once (a new one arrives when one finishes,
as under a client at that concurrency: diagnostics_overhead.py's c=8 workload), up to 32
running, 512-token steps, prefix cache on. Prints the microseconds schedule() and
update_from_output() take per step, per policy, in alternating runs, then the medians: with one
tenant fair share makes fcfs's schedule step for step (asserted by
tests/engine/sched/test_fair_share.py), so their difference is all that the policy costs, to be
set against a real step's time at that batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.simulation import make_scheduler

POLICIES = ("fcfs", "fair-share")


def run(policy: str, num_requests: int, concurrency: int) -> tuple[float, int]:
    """(µs of scheduler time per step, steps) for one policy's whole run."""
    scheduler, runner = make_scheduler(
        num_blocks=4096, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048,
        enable_prefix_cache=True, scheduling_policy=policy,
    )  # fmt: skip
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    requests = [
        EngineRequest(f"r{i}", list(range(1, 200)) + [1000 + i % 250] * 40, params, tenant="t")
        for i in range(num_requests)
    ]
    spent, steps = 0.0, 0
    while requests or scheduler.has_unfinished_requests():
        # Arrivals (not timed): one request per finished one, up to the concurrency.
        while requests and scheduler.num_running + scheduler.num_waiting < concurrency:
            scheduler.add_request(requests.pop(0))
        started = time.perf_counter()
        output = scheduler.schedule()
        spent += time.perf_counter() - started
        result = runner.execute(output)  # the fake model: not timed
        started = time.perf_counter()
        scheduler.update_from_output(output, result)
        spent += time.perf_counter() - started
        steps += 1
    return spent / steps * 1e6, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    micros: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for round_index in range(args.rounds):
        # Alternating which policy goes first, so drift weighs on both alike.
        order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
        for policy in order:
            per_step, steps = run(policy, args.requests, args.concurrency)
            micros[policy].append(per_step)
            print(f"round {round_index + 1} {policy}: {per_step:.0f} us per step, {steps} steps")
    fcfs, fair = (statistics.median(micros[policy]) for policy in POLICIES)
    print(
        f"median per step: fcfs {fcfs:.0f} us, fair-share {fair:.0f} us "
        f"(difference {fair - fcfs:+.0f} us, {fair / fcfs - 1:+.1%})"
    )


if __name__ == "__main__":
    main()
