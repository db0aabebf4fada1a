"""benchmarks/diagnostics_overhead.py's figures, benchmarks/scheduler_cost.py's load, and the
/proc reading and step timeline of benchmarks/serving.py and server_step_timeline.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks.diagnostics_overhead import cpu_seconds, paired
from benchmarks.scheduler_cost import run
from benchmarks.server_step_timeline import summarize
from benchmarks.servers import proc_cpu_seconds


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


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_proc_cpu_seconds_reads_one_threads_time():
    # A thread that spins for 0.3 s of its own CPU time reads that much in its task's stat
    # (clock ticks: within 0.05 s), while the main thread, sleeping meanwhile, reads far less.
    measured = {}

    def spin() -> None:
        stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")
        before, reference = proc_cpu_seconds(stat), time.thread_time()
        while time.thread_time() - reference < 0.3:
            pass
        measured["spin"] = proc_cpu_seconds(stat) - before
        measured["reference"] = time.thread_time() - reference

    main_stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")
    main_before = proc_cpu_seconds(main_stat)
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    assert measured["spin"] == pytest.approx(measured["reference"], abs=0.05)
    assert proc_cpu_seconds(main_stat) - main_before < 0.1


def test_the_timeline_splits_decode_steps_gaps_and_their_parts():
    # Two 5 ms decode steps 1 ms apart, then a 100 ms prefill step 2 ms later: the step rows
    # take the decode steps only, a part counts inside them only, gaps are between any steps.
    records = [
        ("step", 0.000, 0.005), ("native layers", 0.001, 0.004),
        ("step", 0.006, 0.011), ("native layers", 0.007, 0.010),
        ("step", 0.013, 0.113), ("native layers", 0.014, 0.110),
        ("deliver to the loop", 0.005, 0.0055),
    ]  # fmt: skip
    text = summarize(records, num_tokens=3, cpu={"main (event loop)": 3.0}, wall_s=0.2)
    rows = {line.split(" | ")[0].strip("| ").strip(): line for line in text.splitlines()}
    assert "Steps: 3 (2 under 30 ms), 0.11 s of the run's 0.20 s (55%)." in text
    assert rows["decode step"] == "| decode step | 2 | 5.000 | 5.000 |"
    assert rows["native layers"] == "|   native layers | 2 | 3.000 | 3.000 |"
    assert rows["gap between steps"] == "| gap between steps | 2 | 1.500 | 1.500 |"
    assert rows["deliver to the loop"] == "|   deliver to the loop | 1 | 0.500 | 0.500 |"
    assert rows["main (event loop)"] == "| main (event loop) | 1.000 |"
