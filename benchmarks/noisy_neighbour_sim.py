"""Noisy neighbour in scheduler steps: the scheduler alone (torch-free, the fake runner of
tests/engine/fakes.py), so the figures do not depend on the machine's load.

Tenant A keeps 16 requests of 1,000 unique prompt tokens in flight (16 output tokens each);
tenant B sends one 20-token request at a time (2 output tokens). Budget 512 tokens a step,
as config/cpu.yaml. Prints B's time to first token in steps (alone it is 1) per policy.

    PYTHONPATH=. python benchmarks/noisy_neighbour_sim.py
"""

from __future__ import annotations

import random

from engine.core.protocol import EngineRequest
from tests.engine.fakes import make_scheduler, params, step

NUM_STEPS = 600


def simulate(policy: str, seed: int = 0) -> dict:
    scheduler, runner = make_scheduler(
        num_blocks=8192,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=2048,
        scheduling_policy=policy,
    )
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(6, 60) for _ in range(n)]  # noqa: E731
    num_a = 0

    def flood() -> None:
        nonlocal num_a
        request = EngineRequest(f"a{num_a}", prompt(1000), params(max_tokens=16), tenant="A")
        scheduler.add_request(request)
        num_a += 1

    for _ in range(16):
        flood()
    ttft_steps: list[int] = []
    b_index, b_start = 0, None
    for index in range(NUM_STEPS):
        if b_start is None:
            request = EngineRequest(f"b{b_index}", prompt(20), params(max_tokens=2), tenant="B")
            scheduler.add_request(request)
            b_start = index
        for output in step(scheduler, runner):
            if output.request_id.startswith("a") and output.finished:
                flood()
            if output.request_id != f"b{b_index}":
                continue
            if len(ttft_steps) == b_index and any(c.new_token_ids for c in output.outputs):
                ttft_steps.append(index + 1 - b_start)
            if output.finished:
                b_index, b_start = b_index + 1, None
    ttft_steps.sort()
    return {
        "b_requests": len(ttft_steps),
        "b_ttft_steps_p50": ttft_steps[len(ttft_steps) // 2],
        "b_ttft_steps_p99": ttft_steps[max(0, int(len(ttft_steps) * 0.99) - 1)],
        "b_ttft_steps_max": ttft_steps[-1],
        "a_requests_finished": num_a - 16,
    }


if __name__ == "__main__":
    for name in ("fcfs", "fair-share"):
        print(name, simulate(name))
