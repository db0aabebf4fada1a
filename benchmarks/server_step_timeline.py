"""Where a served token's time goes: the engine thread's steps timed inside `kvshare serve`.

    python benchmarks/server_step_timeline.py [--workload unique] [--concurrency 1] \
        [--num-requests 8] [--max-tokens 64] [-- SERVE FLAGS...]

Starts `kvshare serve --config config/cpu.yaml` (plus any flags after `--`) in a child process
whose engine methods are wrapped with timers, runs benchmarks/serving.py against it, stops it,
and prints the median of each part of a decode step (steps under 30 ms): the step itself
(LLMEngine.step) and in it the scheduling, the model run (ModelRunner.launch: on the CPU the
whole step), the native layer stack (NativeDecodeStep.run), the LM head with sampling
(ModelRunner._sample), the scheduler's
update and the stats snapshot; then the gap between two steps and the part of it spent handing
the outputs to the event loop (AsyncEngine._deliver). It also prints the CPU time each server
thread used per output token (/proc), next to the client's own figures. Never part of
`make test`; the offline figure to set beside it is benchmarks/profile_step.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (label, class path, method): the parts timed, in the order printed.
TIMED = (
    ("step", "engine.llm_engine:LLMEngine", "step"),
    ("schedule", "engine.sched.scheduler:Scheduler", "schedule"),
    ("execute", "engine.runtime.model_runner:ModelRunner", "launch"),
    ("native layers", "engine.runtime.cpu.decode_step:NativeDecodeStep", "run"),
    ("LM head + sampling", "engine.runtime.model_runner:ModelRunner", "_sample"),
    ("update", "engine.sched.scheduler:Scheduler", "update_from_output"),
    ("stats snapshot", "engine.llm_engine:LLMEngine", "_publish"),
    ("deliver to the loop", "engine.async_engine:AsyncEngine", "_deliver"),
)
DECODE_STEP_S = 0.030  # longer steps carry prefill chunks


def serve_timed(record_path: str, serve_args: list[str]) -> int:
    """The child: wrap TIMED's methods, dump (label, start, end) at exit, serve."""
    import importlib

    records: list[tuple[str, float, float]] = []
    for label, where, method in TIMED:
        module_name, class_name = where.split(":")
        owner = getattr(importlib.import_module(module_name), class_name)
        setattr(owner, method, _timed(getattr(owner, method), label, records))
    atexit.register(lambda: Path(record_path).write_text(json.dumps(records)))
    from app.cli import main

    return main(["serve", *serve_args])


def _timed(function, label: str, records: list):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            records.append((label, start, time.perf_counter()))

    return timed


def thread_cpu_ms(pid: int) -> dict[str, float]:
    """CPU ms (user + system) of each thread of process pid: "main (event loop)" for the
    main thread, "thread TID" for the others (the engine thread and the kernels' OpenMP
    worker are the busy ones)."""
    from benchmarks.servers import proc_cpu_seconds

    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds = proc_cpu_seconds(task / "stat")
        except OSError:  # the thread ended
            continue
        name = "main (event loop)" if task.name == str(pid) else f"thread {task.name}"
        out[name] = seconds * 1e3
    return out


def summarize(records: list, num_tokens: int, cpu: dict[str, float], wall_s: float) -> str:
    steps = sorted((start, end) for label, start, end in records if label == "step")
    busy_s = sum(end - start for start, end in steps)
    decode = [(s, e) for s, e in steps if e - s < DECODE_STEP_S]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(steps) if b[0] - a[1] < DECODE_STEP_S]

    def within_decode(label: str) -> list[float]:
        spans = [(s, e) for name, s, e in records if name == label]
        return [e - s for s, e in spans if any(a <= s and e <= b for a, b in decode)]

    rows = [("decode step", [e - s for s, e in decode])]
    rows += [(f"  {label}", within_decode(label)) for label, *_ in TIMED[1:-1]]
    rows += [("gap between steps", gaps)]
    delivers = [e - s for name, s, e in records if name == TIMED[-1][0]]
    rows += [(f"  {TIMED[-1][0]}", delivers)]
    lines = [
        f"Steps: {len(steps)} ({len(decode)} under {DECODE_STEP_S * 1e3:.0f} ms), "
        f"{busy_s:.2f} s of the run's {wall_s:.2f} s ({busy_s / wall_s:.0%}).",
        "",
        "| part | count | median ms | mean ms |",
        "|---|---|---|---|",
    ]
    for name, values in rows:
        if values:
            median, mean = statistics.median(values) * 1e3, statistics.fmean(values) * 1e3
            lines.append(f"| {name} | {len(values)} | {median:.3f} | {mean:.3f} |")
    lines += ["", "| server thread | CPU ms per output token |", "|---|---|"]
    for name, ms in sorted(cpu.items(), key=lambda item: -item[1]):
        if ms >= 0.01 * num_tokens:
            lines.append(f"| {name} | {ms / max(1, num_tokens):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return serve_timed(argv[1], argv[2:])
    split = argv.index("--") if "--" in argv else len(argv)
    own, serve_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="unique")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(own)

    from benchmarks import run_summary, servers, serving

    port = servers.free_port()
    record = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [sys.executable, __file__, "--child", str(record), "--config",
               str(REPO / "config/cpu.yaml"), "--port", str(port), "--log-level", "warning",
               *serve_args]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}/v1"
    process = servers.start_server(command, f"{base_url}/models", cwd=REPO)
    try:
        warm = serving.BenchmarkConfig(base_url=base_url, workload="unique", num_requests=2,
                                       concurrency=1, max_tokens=16, seed=3)  # fmt: skip
        asyncio.run(serving.run_benchmark(warm))
        config = serving.BenchmarkConfig(
            base_url=base_url, workload=args.workload, num_requests=args.num_requests,
            concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed,
        )  # fmt: skip
        before = thread_cpu_ms(process.pid)
        first = time.perf_counter()
        results, duration = asyncio.run(serving.run_benchmark(config))
        after = thread_cpu_ms(process.pid)
    finally:
        servers.stop_server(process)
    summary = run_summary.summarize(results, args.workload, args.num_requests, duration)
    print(run_summary.format_markdown(summary))
    records = [r for r in json.loads(record.read_text()) if r[1] >= first]
    record.unlink()
    cpu = {name: after[name] - before.get(name, 0.0) for name in after}
    num_tokens = sum(r.output_tokens for r in results if r.ok)
    print()
    print(summarize(records, num_tokens, cpu, duration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
