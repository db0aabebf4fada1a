"""/health's latency while one request's large answer is computed (issue 55).

--load report (the default): a chat of --messages messages (max_tokens 1) is sent --prompts
times, so the tenant's recent prompts are long; then /debug/cache_report is requested over and
over. --load echo: the largest echo + logprobs completion under the default
max_logprob_entries (2 prompts of 780 token ids, n 32, logprobs 20, max_tokens 0: 1,048,320
entries) is sent over and over. Meanwhile /health is probed every --interval seconds for
--seconds, and on until the last request has its answer. Neither may stall the event loop: the
goal is /health p99 <= 100 ms, and no probe waiting 1 s (a stall is one probe, however long).

    python benchmarks/health_during_report.py                  # a fresh server of this tree
    python benchmarks/health_during_report.py --load echo --seconds 0
    python benchmarks/health_during_report.py --url http://127.0.0.1:8000

Prints the /health latencies (p50, p99, max) and the requests answered meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL_P99_S = 0.1
GOAL_MAX_S = 1.0


def conversation(num_messages: int, number: int) -> list[dict]:
    """A long chat whose turns differ from the other prompts' only at the end."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: note it."}
        for i in range(num_messages - 1)
    ]
    return [*turns, {"role": "user", "content": f"Question {number}?"}]


def fill_history(url: str, num_prompts: int, num_messages: int) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for number in range(num_prompts):
        body = {"model": model, "max_tokens": 1, "messages": conversation(num_messages, number)}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def echo_body(model: str) -> dict:
    """The largest echo + logprobs request: 2 x 32 choices x 780 tokens x (20 + 1) entries."""
    prompt = list(range(1000, 1780))
    return {
        "model": model,
        "prompt": [prompt, prompt],
        "n": 32,  # config/cpu.yaml's max_num_seqs
        "echo": True,
        "logprobs": 20,
        "max_tokens": 0,
    }


def measure(
    url: str, seconds: float, interval: float, send: Callable[[httpx.Client], None]
) -> tuple[list[float], int]:
    """/health latencies while a thread calls send() back to back for `seconds` (at least
    once), probed until its last call returns."""
    num_sent = 0
    deadline = time.monotonic() + seconds

    def load() -> None:
        nonlocal num_sent
        with httpx.Client(timeout=600) as client:
            while True:
                send(client)
                num_sent += 1
                if time.monotonic() >= deadline:
                    return

    worker = threading.Thread(target=load)
    worker.start()
    latencies = []
    with httpx.Client(timeout=60) as client:
        while worker.is_alive():
            start = time.perf_counter()
            client.get(f"{url}/health").raise_for_status()
            latencies.append(time.perf_counter() - start)
            time.sleep(interval)
    worker.join()
    return latencies, num_sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (else one of this tree is started)")
    parser.add_argument("--load", choices=("report", "echo"), default="report")
    parser.add_argument("--messages", type=int, default=401)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=0.02)
    args = parser.parse_args(argv)
    if args.url:
        return report(args, args.url)
    from benchmarks.servers import running_kvshare

    with running_kvshare("--max-messages", str(args.messages)) as url:
        return report(args, url)


def report(args, url: str) -> int:
    if args.load == "echo":
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = echo_body(model)

        def send(client: httpx.Client) -> None:
            client.post(f"{url}/v1/completions", json=body).raise_for_status()

        what = "max-size echo + logprobs completions"
    else:
        fill_history(url, args.prompts, args.messages)

        def send(client: httpx.Client) -> None:
            client.get(f"{url}/debug/cache_report").raise_for_status()

        what = f"reports of {args.prompts} prompts x {args.messages} messages"
    start = time.monotonic()
    latencies, num_sent = measure(url, args.seconds, args.interval, send)
    p99, slowest = statistics.quantiles(latencies, n=100)[98], max(latencies)
    is_met = p99 <= GOAL_P99_S and slowest <= GOAL_MAX_S
    print(
        f"/health over {time.monotonic() - start:.1f} s ({len(latencies)} probes, {num_sent} "
        f"{what}): p50 {1000 * statistics.median(latencies):.1f} ms, p99 {1000 * p99:.1f} ms, "
        f"max {1000 * slowest:.1f} ms; goal p99 <= {1000 * GOAL_P99_S:.0f} ms, max <= "
        f"{1000 * GOAL_MAX_S:.0f} ms: {'met' if is_met else 'MISSED'}"
    )
    return 0 if is_met else 1


if __name__ == "__main__":
    sys.exit(main())
