"""Noisy neighbour in the scheduler alone: the real scheduler (torch-free) with the simulated runner
of engine/simulation.py and a simulated clock, so the figures do not depend on the machine's load.

Tenant A keeps 16 requests of 1,000 unique prompt tokens in flight (16 output tokens each);
tenant B sends one 20-token request at a time (2 output tokens), CLIENT_DELAY_S after its
previous one ended, so that it arrives while a step is running, as it does over HTTP. Budget
512 tokens a step, as config/cpu.yaml. Time is a cost model, not a measurement: a step takes
STEP_S plus TOKEN_S per scheduled token (about the CPU's prefill rate on 2 threads, where a
step's time is about linear in its tokens). Prints a table, a row per policy: the steps run;
B's time to first token in steps (counted from the first step that starts after B's request
arrived: 1 when that step carries its prompt) and in simulated ms (from its arrival, so the
wait for the step in progress counts; alone: 58 ms); the requests A finished.

    PYTHONPATH=. python benchmarks/noisy_neighbour_sim.py
"""

from __future__ import annotations

import random

from engine.core.batch import SchedulerOutput
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.simulation import make_scheduler

SIM_SECONDS = 240.0  # simulated time per policy
STEP_S = 0.010  # cost model: per step
TOKEN_S = 0.0024  # cost model: per scheduled token
CLIENT_DELAY_S = 0.005  # B's next request arrives this long after its previous one ended
NUM_FLOOD = 16
# name -> (scheduling_policy, fair_share_prefill_tokens)
POLICIES = {
    "fcfs": ("fcfs", 0),
    "fair-share, no cap": ("fair-share", 0),
    "fair-share, cap 16": ("fair-share", 16),
    "fair-share, cap 4 (default)": ("fair-share", 4),
}


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_seconds(out: SchedulerOutput) -> float:
    return STEP_S + TOKEN_S * out.num_batched_tokens


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(seed=0, max_tokens=max_tokens, ignore_eos=True)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def simulate(policy: str, prefill_tokens: int, seed: int = 0) -> dict:
    clock = SimClock()
    scheduler, runner = make_scheduler(
        num_blocks=8192,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=2048,
        scheduling_policy=policy,
        fair_share_prefill_tokens=prefill_tokens,
        clock=clock,
    )
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(6, 60) for _ in range(n)]  # noqa: E731
    num_a = 0

    def flood() -> None:
        nonlocal num_a
        request = EngineRequest(f"a{num_a}", prompt(1000), params(16), tenant="A")
        scheduler.add_request(request)
        num_a += 1

    for _ in range(NUM_FLOOD):
        flood()
    ttft_steps: list[int] = []
    ttft_ms: list[float] = []
    b_index, b_arrival, b_sent_step = 0, 0.0, None
    num_steps = 0
    while clock.now < SIM_SECONDS:
        if b_sent_step is None and clock.now >= b_arrival:  # it waited for the step in progress
            request = EngineRequest(f"b{b_index}", prompt(20), params(2), tenant="B")
            scheduler.add_request(request)
            b_sent_step = num_steps
        out = scheduler.schedule()
        runner_out = runner.execute(out)
        clock.now += step_seconds(out)  # the step's outputs come at its end
        num_steps += 1
        for output in scheduler.update_from_output(out, runner_out):
            if output.request_id.startswith("a") and output.finished:
                flood()
            if output.request_id != f"b{b_index}":
                continue
            if len(ttft_steps) == b_index and any(c.new_token_ids for c in output.outputs):
                ttft_steps.append(num_steps - b_sent_step)
                ttft_ms.append(1000 * (clock.now - b_arrival))
            if output.finished:
                b_index, b_sent_step = b_index + 1, None
                b_arrival = clock.now + CLIENT_DELAY_S
    return {
        "b_requests": len(ttft_steps),
        "b_ttft_steps_p50": percentile(ttft_steps, 0.5),
        "b_ttft_steps_max": max(ttft_steps),
        "b_ttft_ms_p50": percentile(ttft_ms, 0.5),
        "b_ttft_ms_p99": percentile(ttft_ms, 0.99),
        "a_requests_finished": num_a - NUM_FLOOD,
        "steps": num_steps,
    }


def main() -> None:
    print(f"{SIM_SECONDS:.0f} simulated seconds per policy; B alone: 1 step, ", end="")
    print(f"{1000 * (STEP_S + 20 * TOKEN_S):.0f} ms")
    print()
    head = ["policy", "steps", "B requests", "B TTFT p50 / max (steps)", "B TTFT p50 / p99 (ms)"]
    head.append("A requests finished")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for name, (policy, prefill_tokens) in POLICIES.items():
        r = simulate(policy, prefill_tokens)
        print(
            f"| {name} | {r['steps']:,} | {r['b_requests']:,} | "
            f"{r['b_ttft_steps_p50']} / {r['b_ttft_steps_max']} | "
            f"{r['b_ttft_ms_p50']:,.0f} / {r['b_ttft_ms_p99']:,.0f} | {r['a_requests_finished']} |"
        )


if __name__ == "__main__":
    main()
