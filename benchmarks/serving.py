"""Serving benchmark: an async load generator for any OpenAI-compatible server.

It streams chat completions and measures what a user feels: time to first token (TTFT), the
gaps between streamed chunks (inter-token latency), end-to-end latency, and throughput. The
prompt and cached token counts come from the usage chunk (`stream_options.include_usage`), so
the fraction of prompt tokens served from the prefix cache is reported too.

    python benchmarks/serving.py --workload shared-prefix --num-requests 64 --concurrency 16 \
        --max-tokens 128 --out benchmarks/results/shared_prefix_c16.json

Output length is fixed with `ignore_eos` + `max_tokens` (kvshare and vLLM accept it); pass
`--no-extensions` for servers that reject non-OpenAI fields. The run is bounded: at most
--num-requests requests, and everything still running after --timeout seconds is cancelled
and counted as unfinished. Its command line is a client only: it starts no server
(benchmarks/servers.py serves the drivers that do, such as benchmarks/vs_llama_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run_summary import Summary, format_markdown, summarize
from benchmarks.workloads import (
    WORKLOADS,
    Conversation,
    arrival_delays,
    build_workload,
    think_times,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


@dataclass
class RequestResult:
    """One streamed request. Latencies are seconds; itl_s holds the gaps between content chunks."""

    conversation_id: int
    turn: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""


@dataclass
class BenchmarkConfig:
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first id from GET /models
    workload: str = "shared-prefix"
    num_requests: int = 64
    concurrency: int | None = None  # max requests in flight; None: unbounded
    request_rate: float = math.inf  # Poisson arrivals of conversations per second
    think_time_s: float = 0.0  # mean pause (exponential) before each later turn; 0: none
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    use_extensions: bool = True  # send ignore_eos so every answer has max_tokens tokens
    api_key: str | None = None


# ---------------------------------------------------------------- statistics


# ---------------------------------------------------------------- client


def request_body(
    config: BenchmarkConfig, model: str, messages: list[dict], max_tokens: int
) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.use_extensions:
        body["ignore_eos"] = True
    return body


def _read_chunk(chunk: dict, result: RequestResult, now: float, token_times: list[float]) -> None:
    if "error" in chunk:
        raise ValueError(f"error chunk: {json.dumps(chunk['error'])[:300]}")
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0
    for choice in chunk.get("choices") or []:
        # Chat chunks carry delta.content; legacy completions chunks carry text.
        content = (choice.get("delta") or {}).get("content") or choice.get("text")
        if content:
            token_times.append(now)
            result.text += content


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    result: RequestResult,
    token_times: list[float] | None = None,
) -> RequestResult:
    """Sends one streaming chat completion and fills `result`; never raises for server faults.
    token_times, when given, gets each content chunk's time as it arrives (the caller sees the
    tokens of a request cancelled midway)."""
    token_times = [] if token_times is None else token_times
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            is_done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (keep-alives), event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    is_done = True
                    break
                _read_chunk(json.loads(data), result, time.perf_counter(), token_times)
    except (httpx.HTTPError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    if not is_done:
        result.error = "stream ended without data: [DONE]"
        return result
    result.e2e_s = time.perf_counter() - start
    if token_times:
        result.ttft_s = token_times[0] - start
        result.itl_s = [b - a for a, b in itertools.pairwise(token_times)]
    result.output_tokens = result.output_tokens or len(token_times)
    result.ok = True
    return result


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists under GET /models."""
    response = await client.get(f"{base_url}/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]


async def _run_conversation(
    client: httpx.AsyncClient,
    config: BenchmarkConfig,
    model: str,
    conversation: Conversation,
    limiter: asyncio.Semaphore | None,
    results: list[RequestResult],
) -> None:
    messages: list[dict] = []
    if conversation.system_prompt is not None:
        messages.append({"role": "system", "content": conversation.system_prompt})
    num_later_turns = len(conversation.user_turns) - 1
    pauses = think_times(
        num_later_turns, config.think_time_s, config.seed, conversation.conversation_id
    )
    for turn, (user, max_tokens) in enumerate(
        zip(conversation.user_turns, conversation.max_tokens, strict=True)
    ):
        if turn > 0 and pauses[turn - 1] > 0:
            await asyncio.sleep(pauses[turn - 1])  # outside the limiter: a reader holds no slot
        messages.append({"role": "user", "content": user})
        body = request_body(config, model, list(messages), max_tokens)
        result = RequestResult(conversation.conversation_id, turn)
        if limiter is None:
            await stream_chat(client, f"{config.base_url}/chat/completions", body, result)
        else:
            async with limiter:
                await stream_chat(client, f"{config.base_url}/chat/completions", body, result)
        results.append(result)
        if not result.ok:
            return  # later turns would resend a broken history
        messages.append({"role": "assistant", "content": result.text})


async def run_benchmark(
    config: BenchmarkConfig, client: httpx.AsyncClient | None = None
) -> tuple[list[RequestResult], float]:
    """Runs the workload; returns the finished requests and the wall time in seconds.

    Requests still running when config.timeout_s runs out are cancelled and left out of the
    results (the summary counts them as unfinished). `client` may be injected (tests).
    """
    conversations = build_workload(
        config.workload, config.num_requests, config.max_tokens, config.seed
    )
    delays = arrival_delays(len(conversations), config.request_rate, config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    owns_client = client is None
    if client is None:
        # trust_env=False: no proxy between the load generator and the server under test.
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers=headers,
            trust_env=False,
        )
    results: list[RequestResult] = []
    limiter = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    start = time.perf_counter()
    try:
        model = config.model or await discover_model(client, config.base_url)
        await asyncio.wait_for(
            _launch(client, config, model, conversations, delays, limiter, results),
            timeout=config.timeout_s,
        )
    except TimeoutError:
        pass  # what finished counts; the rest is unfinished
    finally:
        if owns_client:
            await client.aclose()
    return results, time.perf_counter() - start


async def _launch(
    client: httpx.AsyncClient,
    config: BenchmarkConfig,
    model: str,
    conversations: list[Conversation],
    delays: list[float],
    limiter: asyncio.Semaphore | None,
    results: list[RequestResult],
) -> None:
    async with asyncio.TaskGroup() as group:
        for conversation, delay in zip(conversations, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)
            group.create_task(
                _run_conversation(client, config, model, conversation, limiter, results)
            )


# ---------------------------------------------------------------- command line


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible /v1 URL")
    parser.add_argument("--model", default=None, help="model id (default: first of GET /models)")
    parser.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    parser.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second"
    )
    parser.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="mean seconds (exponential) a user waits before each later turn; 0: none",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="limit for the whole run (s)")
    parser.add_argument(
        "--no-extensions", action="store_true", help="do not send ignore_eos (strict servers)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[BenchmarkConfig, Path | None]:
    """The run's configuration and the JSON output path (None: print only)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.max_tokens < 1 or args.timeout <= 0:
        parser.error("--num-requests, --max-tokens and --timeout must be positive")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        parser.error("--request-rate must be positive")
    if args.think_time < 0:
        parser.error("--think-time must not be negative")
    # Neither given: one request at a time. A rate alone leaves concurrency unbounded.
    concurrency = args.concurrency or (None if args.request_rate else 1)
    config = BenchmarkConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        workload=args.workload,
        num_requests=args.num_requests,
        concurrency=concurrency,
        request_rate=args.request_rate or math.inf,
        think_time_s=args.think_time,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        timeout_s=args.timeout,
        use_extensions=not args.no_extensions,
        api_key=args.api_key,
    )
    return config, args.out


def report_json(config: BenchmarkConfig, summary: Summary, results: list[RequestResult]) -> dict:
    """Everything a later comparison needs; per-request records without the generated text."""
    settings = asdict(config)
    settings.pop("api_key")
    if math.isinf(config.request_rate):
        settings["request_rate"] = None  # JSON has no Infinity
    requests = [{k: v for k, v in asdict(r).items() if k != "text"} for r in results]
    return {"config": settings, "summary": asdict(summary), "requests": requests}


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every request completed, 1 when some failed or ran out of time."""
    config, out = parse_args(argv)
    try:
        results, duration_s = asyncio.run(run_benchmark(config))
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"benchmark could not start: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    summary = summarize(results, config.workload, config.num_requests, duration_s)
    print(format_markdown(summary))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report_json(config, summary, results), indent=2) + "\n")
    return 0 if summary.completed == summary.num_requests else 1


if __name__ == "__main__":
    sys.exit(main())
