"""benchmarks/diagnostics_overhead.py's figures and benchmarks/scheduler_cost.py's load."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.diagnostics_overhead import cpu_seconds, paired
from benchmarks.scheduler_cost import run


def test_paired_is_the_median_of_same_round_ratios_with_quartiles():
    # Ratios -50%, 0%, +100%, +20%, -10%: sorted -0.5, -0.1, 0, 0.2, 1.0; median 0.
    # Quartiles (statistics' exclusive method, n=5): positions 1.5 and 4.5 -> -0.3 and 0.6.
    text = paired([1.0, 2.0, 4.0, 1.2, 0.9], [2.0, 2.0, 2.0, 1.0, 1.0])
    assert text == "+0.0% (-30.0% .. +60.0%)"
    assert paired([1.1], [1.0]) == "+10.0%"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_cpu_seconds_counts_this_process_like_os_times():
    before, reference_before = cpu_seconds(os.getpid()), os.times()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # busy: CPU time, not sleep
        pass
    spent = cpu_seconds(os.getpid()) - before
    after = os.times()
    reference = (after.user + after.system) - (reference_before.user + reference_before.system)
    assert spent == pytest.approx(reference, abs=0.05)
    assert spent >= 0.25


def test_scheduler_cost_runs_the_same_steps_under_both_policies():
    # One tenant: fair share schedules as fcfs, step for step, so the step counts agree; and
    # a client concurrency of 8 runs 32 requests of 32 tokens in more steps than 32 at once.
    _, fcfs_steps = run("fcfs", 32, 8)
    _, fair_steps = run("fair-share", 32, 8)
    _, crowd_steps = run("fcfs", 32, 32)
    assert fcfs_steps == fair_steps
    assert crowd_steps < fcfs_steps
