"""The scheduler's own time per step under each policy, with no model (torch-free).

    PYTHONPATH=. python benchmarks/scheduler_cost.py [--rounds 3] [--requests 64]

The real Scheduler and KVCacheManager with the fake runner of tests/engine/fakes.py: one
tenant's requests (a shared 199-token prefix, then 40 tokens of their own, 32 output tokens),
up to 32 running, 512-token steps, prefix cache on. Prints the microseconds schedule() and
update_from_output() take per step, per policy, in alternating runs: with one tenant fair share
makes fcfs's schedule step for step, so any difference is the policy's bookkeeping.
"""

from __future__ import annotations

import argparse
import time

from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from tests.engine.fakes import make_scheduler


def run(policy: str, num_requests: int) -> tuple[float, int]:
    """(µs of scheduler time per step, steps) for one policy's whole run."""
    scheduler, runner = make_scheduler(
        num_blocks=4096, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048,
        enable_prefix_cache=True, scheduling_policy=policy, fair_share_prefill_tokens=16,
    )  # fmt: skip
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for i in range(num_requests):
        prompt = list(range(1, 200)) + [1000 + i % 250] * 40
        scheduler.add_request(EngineRequest(f"r{i}", prompt, params, tenant="t"))
    spent, steps = 0.0, 0
    while scheduler.has_unfinished_requests():
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    for round_index in range(args.rounds):
        for policy in ("fcfs", "fair-share"):
            micros, steps = run(policy, args.requests)
            print(f"round {round_index + 1} {policy}: {micros:.0f} us per step over {steps} steps")


if __name__ == "__main__":
    main()
