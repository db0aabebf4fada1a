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
(start_server/stop_server serve the drivers that do, such as benchmarks/vs_llama_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORKLOADS = ("shared-prefix", "multi-turn", "unique", "mixed-length", "many-system-prompts")
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# About one token per common English word with a BPE tokenizer: ~200 tokens of system prompt.
SHARED_PREFIX_WORDS = 190
QUESTION_WORDS = 12
TURNS_PER_CONVERSATION = 4
MIXED_MIN_PROMPT_WORDS = 16
MIXED_MAX_PROMPT_WORDS = 768
NUM_SYSTEM_PROMPTS = 8  # many-system-prompts: distinct ~200-token system prompts

_VOCABULARY = (
    "the system answers every question about orders shipping returns and payments with care "
    "customer account invoice refund warehouse delivery address package tracking number "
    "policy product price discount coupon member support agent ticket priority email phone "
    "window days business weekend holiday region country currency tax receipt label carrier "
    "damaged missing late early exchange replacement warranty repair battery screen cable "
    "charger laptop tablet camera speaker kitchen garden office chair table lamp blanket "
    "always never politely briefly clearly first then finally before after because unless "
    "check confirm explain apologize escalate verify update cancel schedule compare include"
)
_WORDS = _VOCABULARY.split()


@dataclass
class Conversation:
    """User turns sent one after another; each turn resends the history and the answers so far."""

    conversation_id: int
    user_turns: list[str]
    max_tokens: list[int]  # one per turn
    system_prompt: str | None = None


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


# ---------------------------------------------------------------- workloads


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _nonce(rng: random.Random) -> str:
    # A distinct opening so that unrelated prompts share no prefix beyond the chat template.
    return f"[{rng.randrange(10**9):09d}]"


def _question(rng: random.Random, index: int) -> str:
    return f"Question {index}: {_words(rng, QUESTION_WORDS)}?"


def build_workload(name: str, num_requests: int, max_tokens: int, seed: int) -> list[Conversation]:
    """Deterministic conversations for a workload; their turns add up to exactly num_requests.

    shared-prefix: one ~200-token system prompt for all, a short different question each.
    multi-turn:    4-turn conversations (the last one may be shorter), each opening with its own
                   context; every turn resends the history with the answers appended.
    unique:        prompts as long as the shared-prefix ones but sharing nothing.
    mixed-length:  unique prompts of log-uniform length, max_tokens in [max_tokens/8, max_tokens].
    many-system-prompts: 8 distinct ~200-token system prompts, each shared by several users
                   (request i uses prompt i % 8) in a shuffled order, a different question each.
    """
    if num_requests < 1 or max_tokens < 1:
        raise ValueError("num_requests and max_tokens must be at least 1")
    rng = random.Random(seed)
    if name == "shared-prefix":
        system = f"You are a support assistant. {_words(rng, SHARED_PREFIX_WORDS)}."
        return [
            Conversation(i, [_question(rng, i)], [max_tokens], system) for i in range(num_requests)
        ]
    if name == "multi-turn":
        return _multi_turn(rng, num_requests, max_tokens)
    if name == "unique":
        return [_unique(rng, i, max_tokens) for i in range(num_requests)]
    if name == "mixed-length":
        return [_mixed_length(rng, i, max_tokens) for i in range(num_requests)]
    if name == "many-system-prompts":
        return _many_system_prompts(rng, num_requests, max_tokens)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def _multi_turn(rng: random.Random, num_requests: int, max_tokens: int) -> list[Conversation]:
    conversations = []
    for conversation_id, first in enumerate(range(0, num_requests, TURNS_PER_CONVERSATION)):
        num_turns = min(TURNS_PER_CONVERSATION, num_requests - first)
        opening = f"{_nonce(rng)} Context: {_words(rng, 60)}. {_question(rng, 0)}"
        turns = [opening] + [_question(rng, t) for t in range(1, num_turns)]
        conversations.append(Conversation(conversation_id, turns, [max_tokens] * num_turns))
    return conversations


def _many_system_prompts(
    rng: random.Random, num_requests: int, max_tokens: int
) -> list[Conversation]:
    systems = [
        f"{_nonce(rng)} You are support assistant {k}. {_words(rng, SHARED_PREFIX_WORDS)}."
        for k in range(NUM_SYSTEM_PROMPTS)
    ]
    # Shuffled, so that a router that simply alternates does not keep each prompt on one
    # replica by accident of the arrival order.
    order = list(range(num_requests))
    rng.shuffle(order)
    return [
        Conversation(i, [_question(rng, i)], [max_tokens], systems[i % NUM_SYSTEM_PROMPTS])
        for i in order
    ]


def _unique(rng: random.Random, index: int, max_tokens: int) -> Conversation:
    prompt = f"{_nonce(rng)} {_words(rng, SHARED_PREFIX_WORDS + QUESTION_WORDS)}?"
    return Conversation(index, [prompt], [max_tokens])


def _mixed_length(rng: random.Random, index: int, max_tokens: int) -> Conversation:
    log_low, log_high = math.log(MIXED_MIN_PROMPT_WORDS), math.log(MIXED_MAX_PROMPT_WORDS)
    num_words = round(math.exp(rng.uniform(log_low, log_high)))
    num_tokens = rng.randint(max(1, max_tokens // 8), max_tokens)
    return Conversation(index, [f"{_nonce(rng)} {_words(rng, num_words)}?"], [num_tokens])


def think_times(num_pauses: int, mean_s: float, seed: int, conversation_id: int) -> list[float]:
    """A user's pauses in seconds between reading an answer and sending the next turn (one
    per later turn): exponential with mean mean_s (all 0 at mean 0), per conversation and seed."""
    if mean_s < 0:
        raise ValueError("mean_s must not be negative")
    if mean_s == 0:
        return [0.0] * num_pauses
    rng = random.Random(f"think-{seed}-{conversation_id}")
    return [rng.expovariate(1.0 / mean_s) for _ in range(num_pauses)]


def arrival_delays(num_arrivals: int, request_rate: float, seed: int) -> list[float]:
    """Gaps in seconds before each arrival: exponential (a Poisson process), all 0 at rate inf."""
    if request_rate <= 0:
        raise ValueError("request_rate must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_arrivals
    rng = random.Random(seed + 1)  # its own stream: the prompts do not depend on the rate
    return [rng.expovariate(request_rate) for _ in range(num_arrivals)]


# ---------------------------------------------------------------- statistics


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


# ---------------------------------------------------------------- client


def _request_body(
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
        body = _request_body(config, model, list(messages), max_tokens)
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


# ---------------------------------------------------------------- server processes


def proc_cpu_seconds(stat: Path, children: bool = False) -> float:
    """User + system CPU seconds in a /proc stat file: /proc/PID/stat for a process, or
    /proc/PID/task/TID/stat for one of its threads; children: with its waited-for children's."""
    # After the command name (which may hold spaces) the fields start with the state: utime,
    # stime, cutime and cstime are fields 14-17 of the whole line.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(value) for value in fields[11 : 15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    command: list[str],
    ready_url: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    log: Path | None = None,
) -> subprocess.Popen:
    """Start a server process and wait until GET ready_url answers 200 (raise if it exits or
    the time runs out, after stopping it). Its output goes to `log` (default: discarded)."""
    sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        command, cwd=cwd, env={**os.environ, **(env or {})}, stdout=sink, stderr=sink
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(ready_url, timeout=2.0, trust_env=False).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    except BaseException:  # Ctrl-C while waiting: the server must not outlive the driver
        stop_server(process)
        raise
    stop_server(process)
    raise RuntimeError(f"{command[0]} did not become ready at {ready_url} (log: {log})")


def stop_server(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT (a graceful stop), then SIGKILL after timeout_s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running_kvshare(*flags: str) -> Iterator[str]:
    """A `kvshare serve` of this tree (config/cpu.yaml, the exact mode unless `flags` choose)
    on a free loopback port; yields its base URL, stops it at the end."""
    port = free_port()
    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if "--quantization" not in flags:
        command += ["--quantization", "none"]
    process = start_server([*command, *flags], f"http://127.0.0.1:{port}/ready", cwd=repo)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$")


def scrape(base_url: str, operator_key: str | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (labels exactly as the server prints them);
    operator_key: the server's operator key, where it has operator_keys."""
    headers = {} if operator_key is None else {"Authorization": f"Bearer {operator_key}"}
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    response.raise_for_status()
    samples = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match["name"] + (match["labels"] or "")] = float(match["value"])
    return samples


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
