"""benchmarks/serving.py: workloads, statistics, and the client against a fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from benchmarks.run_summary import distribution, format_markdown, percentile, summarize
from benchmarks.serving import BenchmarkConfig, RequestResult, main, parse_args, run_benchmark
from benchmarks.workloads import SHARED_PREFIX_WORDS, arrival_delays, build_workload, think_times

BASE_URL = "http://fake/v1"
EOS_AFTER = 3  # the fake model "emits EOS" after this many tokens unless ignore_eos is set


class FakeOpenAI:
    """A tiny OpenAI-compatible streaming server. Prompt tokens are words; a system prompt seen
    before counts as cached. Records every request body, when each arrived, and the peak number
    in flight."""

    def __init__(self, fail_status: int | None = None, hang: bool = False) -> None:
        self.bodies: list[dict] = []
        self.arrived_s: list[float] = []  # time.perf_counter() at each request
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.fail_status = fail_status
        self.hang = hang
        self.seen_system_prompts: set[str] = set()
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(self, request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived_s.append(time.perf_counter())
        if self.fail_status is not None:
            error = {"message": "boom", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=self.fail_status)
        messages = body["messages"]
        num_prompt_tokens = sum(len(m["content"].split()) for m in messages)
        num_cached_tokens = 0
        if messages[0]["role"] == "system":
            if messages[0]["content"] in self.seen_system_prompts:
                num_cached_tokens = len(messages[0]["content"].split())
            self.seen_system_prompts.add(messages[0]["content"])
        num_tokens = body["max_tokens"] if body.get("ignore_eos") else EOS_AFTER
        events = self._events(body, num_prompt_tokens, num_cached_tokens, num_tokens)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, body: dict, num_prompt: int, num_cached: int, num_tokens: int):
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            if self.hang:
                await asyncio.Event().wait()
            for i in range(num_tokens):
                await asyncio.sleep(0)  # let the other streams interleave
                yield _sse({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            if body.get("stream_options", {}).get("include_usage"):
                usage = {
                    "prompt_tokens": num_prompt,
                    "completion_tokens": num_tokens,
                    "total_tokens": num_prompt + num_tokens,
                    "prompt_tokens_details": {"cached_tokens": num_cached},
                }
                yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            self.num_in_flight -= 1


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _run(fake: FakeOpenAI, **overrides) -> tuple[list[RequestResult], float]:
    config = BenchmarkConfig(base_url=BASE_URL, **overrides)

    async def go():
        transport = httpx.ASGITransport(app=fake.app)
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_benchmark(config, client)

    return asyncio.run(go())


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([7.0], 99, 7.0),
        ([10.0, 0.0], 25, 2.5),
    ],
)
def test_percentile_interpolates_linearly(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_rejects_bad_input(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_distribution_of_nothing_is_none_and_of_values_is_exact():
    assert distribution([]) is None
    dist = distribution([0.1, 0.2, 0.3, 0.4])
    assert (dist.mean, dist.p50) == pytest.approx((0.25, 0.25))


def test_summarize_counts_and_fractions():
    ok = RequestResult(0, 0, ok=True, prompt_tokens=100, cached_tokens=40, output_tokens=5)
    ok.ttft_s, ok.e2e_s, ok.itl_s = 0.5, 0.9, [0.1, 0.1, 0.1, 0.1]
    other = RequestResult(1, 0, ok=True, prompt_tokens=100, cached_tokens=60, output_tokens=1)
    other.ttft_s, other.e2e_s = 0.3, 0.3
    bad = RequestResult(2, 0, error="HTTP 500: boom")
    summary = summarize([ok, other, bad], "unique", num_requests=4, duration_s=2.0)
    assert (summary.completed, summary.failed, summary.unfinished) == (2, 1, 1)
    assert (summary.prompt_tokens, summary.cached_tokens, summary.output_tokens) == (200, 100, 6)
    assert summary.cached_fraction == pytest.approx(0.5)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_token_throughput == pytest.approx(3.0)
    assert summary.tpot_s.mean == pytest.approx(0.1)  # only the 5-token request has a TPOT
    assert summary.ttft_s.mean == pytest.approx(0.4)
    assert summary.errors == ["HTTP 500: boom"]
    table = format_markdown(summary)
    assert "| cached prompt tokens | 100 (50.0%) |" in table
    assert "| TTFT | 400.0 | 400.0 | 480.0 | 498.0 |" in table


# ---------------------------------------------------------------- workloads


def test_shared_prefix_shares_one_system_prompt_and_asks_different_questions():
    conversations = build_workload("shared-prefix", 6, max_tokens=16, seed=3)
    assert len(conversations) == 6
    assert len({c.system_prompt for c in conversations}) == 1
    system_words = conversations[0].system_prompt.split()
    assert len(system_words) == SHARED_PREFIX_WORDS + 5  # "You are a support assistant."
    assert len({c.user_turns[0] for c in conversations}) == 6
    assert all(c.max_tokens == [16] for c in conversations)


def test_workloads_are_deterministic_per_seed():
    for name in ("shared-prefix", "multi-turn", "unique", "mixed-length", "many-system-prompts"):
        assert build_workload(name, 9, 32, seed=1) == build_workload(name, 9, 32, seed=1)
        assert build_workload(name, 9, 32, seed=1) != build_workload(name, 9, 32, seed=2)


def test_multi_turn_splits_requests_into_four_turn_conversations():
    conversations = build_workload("multi-turn", 10, max_tokens=8, seed=0)
    assert [len(c.user_turns) for c in conversations] == [4, 4, 2]
    assert [c.conversation_id for c in conversations] == [0, 1, 2]
    assert all(c.system_prompt is None for c in conversations)
    openings = [c.user_turns[0] for c in conversations]
    assert len({o.split()[0] for o in openings}) == 3  # distinct nonces


def test_unique_prompts_differ_from_the_first_word():
    conversations = build_workload("unique", 20, max_tokens=8, seed=0)
    first_words = {c.user_turns[0].split()[0] for c in conversations}
    assert len(first_words) == 20
    assert all(c.system_prompt is None for c in conversations)


def test_mixed_length_stays_within_bounds():
    conversations = build_workload("mixed-length", 50, max_tokens=64, seed=0)
    num_words = [len(c.user_turns[0].split()) - 1 for c in conversations]  # minus the nonce
    max_tokens = [c.max_tokens[0] for c in conversations]
    assert all(16 <= n <= 768 for n in num_words)
    assert all(8 <= m <= 64 for m in max_tokens)
    assert len(set(num_words)) > 10
    assert len(set(max_tokens)) > 10


def test_many_system_prompts_shares_each_of_eight_prompts_among_several_users():
    conversations = build_workload("many-system-prompts", 24, max_tokens=8, seed=0)
    assert sorted(c.conversation_id for c in conversations) == list(range(24))
    by_prompt: dict[str, list[int]] = {}
    for c in conversations:
        by_prompt.setdefault(c.system_prompt, []).append(c.conversation_id)
    assert sorted(len(ids) for ids in by_prompt.values()) == [3] * 8
    assert all(len(prompt.split()) > SHARED_PREFIX_WORDS for prompt in by_prompt)
    assert len({prompt.split()[0] for prompt in by_prompt}) == 8  # distinct from the first word
    assert len({c.user_turns[0] for c in conversations}) == 24
    arrival = [c.conversation_id for c in conversations]
    assert arrival != sorted(arrival)  # shuffled: alternating routers get no free affinity


@pytest.mark.parametrize(("name", "num"), [("nope", 1), ("unique", 0)])
def test_build_workload_rejects_bad_arguments(name, num):
    with pytest.raises(ValueError):
        build_workload(name, num, max_tokens=8, seed=0)


def test_arrival_delays():
    assert arrival_delays(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    delays = arrival_delays(200, 4.0, seed=0)
    assert delays == arrival_delays(200, 4.0, seed=0)
    assert delays != arrival_delays(200, 4.0, seed=1)
    assert all(d > 0 for d in delays)
    assert 0.15 < sum(delays) / len(delays) < 0.35  # mean 1/rate = 0.25
    with pytest.raises(ValueError):
        arrival_delays(1, 0.0, seed=0)


# ---------------------------------------------------------------- client against a fake server


def test_shared_prefix_run_reports_tokens_and_cached_fraction():
    fake = FakeOpenAI()
    results, _ = _run(fake, workload="shared-prefix", num_requests=5, max_tokens=4, concurrency=1)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [4] * 5
    assert [r.text for r in results] == ["t0 t1 t2 t3 "] * 5
    assert all(len(r.itl_s) == 3 and r.ttft_s is not None for r in results)
    system_tokens = SHARED_PREFIX_WORDS + 5
    assert [r.cached_tokens for r in results] == [0] + [system_tokens] * 4
    body = fake.bodies[0]
    assert body["model"] == "fake-model"  # discovered through GET /models
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["ignore_eos"], body["max_tokens"], body["temperature"]) == (True, 4, 0.0)
    summary = summarize(results, "shared-prefix", 5, 1.0)
    assert summary.cached_fraction == pytest.approx(
        4 * system_tokens / sum(r.prompt_tokens for r in results)
    )


def test_no_extensions_sends_only_openai_fields():
    fake = FakeOpenAI()
    results, _ = _run(fake, workload="unique", num_requests=2, max_tokens=8, use_extensions=False)
    assert "ignore_eos" not in fake.bodies[0]
    assert [r.output_tokens for r in results] == [EOS_AFTER, EOS_AFTER]


def test_multi_turn_resends_history_with_answers():
    fake = FakeOpenAI()
    results, _ = _run(fake, workload="multi-turn", num_requests=4, max_tokens=2, concurrency=1)
    assert [r.turn for r in results] == [0, 1, 2, 3]
    assert [len(b["messages"]) for b in fake.bodies] == [1, 3, 5, 7]
    last = fake.bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in last[1::2]] == ["t0 t1 "] * 3
    assert last[:5] == fake.bodies[2]["messages"]


def test_think_times_are_exponential_per_conversation_and_seed():
    assert think_times(3, 0.0, seed=0, conversation_id=0) == [0.0, 0.0, 0.0]
    pauses = think_times(400, 2.0, seed=0, conversation_id=0)
    assert pauses == think_times(400, 2.0, seed=0, conversation_id=0)
    assert pauses != think_times(400, 2.0, seed=0, conversation_id=1)  # users differ
    assert pauses != think_times(400, 2.0, seed=1, conversation_id=0)
    assert all(p > 0 for p in pauses)
    assert 1.6 < sum(pauses) / len(pauses) < 2.4  # mean 2.0
    with pytest.raises(ValueError):
        think_times(1, -1.0, seed=0, conversation_id=0)


def test_think_time_pauses_between_turns_without_holding_a_slot():
    fake = FakeOpenAI()
    mean_s = 1.0  # seed 0: the two users' three pauses add up to 2.25 s and 0.90 s
    config = {"workload": "multi-turn", "num_requests": 8, "max_tokens": 2, "concurrency": 1}
    results, duration_s = _run(fake, think_time_s=mean_s, **config)
    assert len(results) == 8 and all(r.ok for r in results)
    # Each conversation's later turn arrives no sooner than its pause after the turn before.
    pauses = {c: think_times(3, mean_s, seed=0, conversation_id=c) for c in (0, 1)}
    for conversation_id in (0, 1):
        opening = fake.bodies[conversation_id]["messages"][0]["content"]
        mine = [
            t
            for t, body in zip(fake.arrived_s, fake.bodies, strict=True)
            if body["messages"][0]["content"] == opening
        ]
        assert len(mine) == 4
        for turn in (1, 2, 3):
            assert mine[turn] - mine[turn - 1] >= pauses[conversation_id][turn - 1]
    # One slot, yet the pauses overlap: had a pausing user held the slot, the run would last
    # at least the sum of both users' pauses (3.15 s); it lasts about the longer one (2.25 s).
    total = [sum(pauses[c]) for c in (0, 1)]
    assert max(total) <= duration_s < sum(total)


def test_concurrency_bounds_requests_in_flight():
    fake = FakeOpenAI()
    results, _ = _run(fake, workload="unique", num_requests=8, max_tokens=4, concurrency=2)
    assert len(results) == 8
    assert 1 <= fake.max_in_flight <= 2


def test_http_errors_are_counted_not_raised():
    fake = FakeOpenAI(fail_status=500)
    results, _ = _run(fake, workload="multi-turn", num_requests=8, max_tokens=4)
    # A failed turn ends its conversation: one failed request per conversation.
    assert len(results) == 2
    assert all(not r.ok and r.error.startswith("HTTP 500") for r in results)
    summary = summarize(results, "multi-turn", 8, 1.0)
    assert (summary.completed, summary.failed, summary.unfinished) == (0, 2, 6)


def test_timeout_leaves_hanging_requests_unfinished():
    fake = FakeOpenAI(hang=True)
    results, _ = _run(fake, workload="unique", num_requests=3, max_tokens=4, timeout_s=0.2)
    assert results == []
    assert fake.num_in_flight == 0  # the streams were cancelled


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize(
    ("argv", "concurrency", "rate"),
    [
        ([], 1, math.inf),
        (["--request-rate", "2.5"], None, 2.5),
        (["--request-rate", "2.5", "--concurrency", "8"], 8, 2.5),
        (["--concurrency", "8"], 8, math.inf),
    ],
)
def test_parse_args_concurrency_and_rate(argv, concurrency, rate):
    config, out = parse_args(argv)
    assert (config.concurrency, config.request_rate, out) == (concurrency, rate, None)
    assert config.base_url == "http://127.0.0.1:8000/v1"  # loopback unless told otherwise


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "0"],
        ["--request-rate", "0"],
        ["--num-requests", "0"],
        ["--workload", "x"],
        ["--think-time", "-1"],
    ],
)
def test_parse_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)


def _serve(app: Starlette) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    return server, thread, sock.getsockname()[1]


def test_main_against_uvicorn_prints_table_and_writes_json(tmp_path, capsys):
    fake = FakeOpenAI()
    server, thread, port = _serve(fake.app)
    out = tmp_path / "results" / "run.json"
    try:
        argv = ["--base-url", f"http://127.0.0.1:{port}/v1", "--workload", "shared-prefix"]
        argv += ["--num-requests", "6", "--concurrency", "3", "--max-tokens", "5"]
        argv += ["--out", str(out), "--timeout", "60"]
        assert main(argv) == 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    printed = capsys.readouterr().out
    assert "### shared-prefix: 6/6 completed, 0 failed, 0 unfinished" in printed
    assert "| TTFT |" in printed
    report = json.loads(out.read_text())
    assert report["config"]["request_rate"] is None
    assert report["config"]["concurrency"] == 3
    assert "api_key" not in report["config"]
    assert report["summary"]["completed"] == 6
    assert report["summary"]["output_tokens"] == 30
    assert len(report["requests"]) == 6
    assert "text" not in report["requests"][0]


def test_main_returns_2_when_no_server_listens(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port now
    assert main(["--base-url", f"http://127.0.0.1:{port}/v1", "--num-requests", "1"]) == 2
    assert "could not start" in capsys.readouterr().err
