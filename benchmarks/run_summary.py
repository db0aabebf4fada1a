"""A serving run's summary: latency percentiles over the finished requests, throughput and
cached-token counts, and its Markdown table (benchmarks/serving.py measures the requests); the
CPU a run ran on."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.serving import RequestResult


@dataclass
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass
class Summary:
    workload: str
    num_requests: int  # planned
    completed: int
    failed: int  # an HTTP error, a broken stream or an error chunk
    unfinished: int  # not sent or still running when --timeout ran out
    duration_s: float
    request_throughput: float  # completed requests per second
    output_token_throughput: float  # output tokens of completed requests per second
    prompt_tokens: int
    cached_tokens: int
    cached_fraction: float  # cached_tokens / prompt_tokens
    output_tokens: int
    ttft_s: Distribution | None
    itl_s: Distribution | None
    tpot_s: Distribution | None  # (e2e - ttft) / (output_tokens - 1), per request
    e2e_s: Distribution | None
    errors: list[str] = field(default_factory=list)  # the first few, for the reader


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> Distribution | None:
    if not values:
        return None
    return Distribution(
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def summarize(
    results: list[RequestResult], workload: str, num_requests: int, duration_s: float
) -> Summary:
    """Aggregates finished requests; latencies come from the successful ones only."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None
    ]
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        workload=workload,
        num_requests=num_requests,
        completed=len(done),
        failed=len(failed),
        unfinished=num_requests - len(results),
        duration_s=duration_s,
        request_throughput=len(done) * per_second,
        output_token_throughput=output_tokens * per_second,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cached_fraction=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        output_tokens=output_tokens,
        ttft_s=distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_s=distribution([gap for r in done for gap in r.itl_s]),
        tpot_s=distribution(tpot),
        e2e_s=distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        errors=[r.error or "unknown error" for r in failed[:5]],
    )


def format_markdown(summary: Summary) -> str:
    """A Markdown report: counts and throughput, then latency percentiles in milliseconds."""
    lines = [
        f"### {summary.workload}: {summary.completed}/{summary.num_requests} completed, "
        f"{summary.failed} failed, {summary.unfinished} unfinished",
        "",
        "| metric | value |",
        "| --- | ---: |",
        f"| duration (s) | {summary.duration_s:.2f} |",
        f"| request throughput (req/s) | {summary.request_throughput:.2f} |",
        f"| output token throughput (tok/s) | {summary.output_token_throughput:.1f} |",
        f"| prompt tokens | {summary.prompt_tokens} |",
        f"| cached prompt tokens | {summary.cached_tokens} ({summary.cached_fraction:.1%}) |",
        f"| output tokens | {summary.output_tokens} |",
        "",
        "| latency (ms) | mean | p50 | p90 | p99 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, dist in (
        ("TTFT", summary.ttft_s),
        ("inter-token", summary.itl_s),
        ("time per output token", summary.tpot_s),
        ("end-to-end", summary.e2e_s),
    ):
        cells = [f"{1000 * v:.1f}" for v in asdict(dist).values()] if dist else ["-"] * 4
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines.extend(f"\nerror: {error}" for error in summary.errors)
    return "\n".join(lines)


def cpu_line() -> str:
    """The CPU model, its cores and vector flags (as lscpu reads them from /proc/cpuinfo)."""
    model, flags = "unknown CPU", []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = info.split("model name")[1].split(":", 1)[1].split("\n", 1)[0].strip()
        cpu_flags = info.split("\nflags")[1].split(":", 1)[1].split("\n", 1)[0].split()
        flags = sorted(f for f in cpu_flags if f.startswith(("avx", "fma", "amx")))
    except (OSError, IndexError):
        pass
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(flags)}"
