"""AsyncEngine on a tiny random Llama: stats are pushed once per step, never pulled."""

from __future__ import annotations

import asyncio
import re

import pytest

from app.metrics import ServerMetrics
from engine.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.errors import ModelNotFoundError
from engine.core.protocol import EngineRequest, EngineStats
from engine.core.sampling_params import SamplingParams
from tests.engine.engine_helpers import started_async_engine

pytestmark = pytest.mark.anyio

NUM_REQUESTS = 3
MAX_TOKENS = 6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _run(engine: AsyncEngine, request_id: str, prompt: list[int]) -> int:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    num_tokens = 0
    admitted = await asyncio.to_thread(engine.admit, EngineRequest(request_id, prompt, params))
    async for output in engine.generate(admitted):
        num_tokens += sum(len(choice.new_token_ids) for choice in output.outputs)
    return num_tokens


def _histogram_count(text: str, name: str) -> float:
    match = re.search(rf"^{name}_count (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
async def test_every_step_reaches_each_listener_once(make_tiny_model, async_scheduling) -> None:
    config = EngineConfig(
        model=str(make_tiny_model()), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    received: list[EngineStats] = []
    metrics = ServerMetrics()
    engine = await started_async_engine(config)
    engine.add_stats_listener(received.append)
    engine.add_stats_listener(metrics.observe_engine)
    prompts = [[5 + i, 9, 17, 33, 4 + i] for i in range(NUM_REQUESTS)]
    counts = await asyncio.gather(*(_run(engine, f"r{i}", p) for i, p in enumerate(prompts)))
    await asyncio.sleep(1.2)  # the idle engine publishes again (its 0.5 s wake-up)
    await engine.shutdown()
    await asyncio.sleep(0)  # callbacks the engine thread queued before it stopped

    assert counts == [MAX_TOKENS] * NUM_REQUESTS
    last = engine.stats()
    assert last is received[-1]  # stats() is the latest pushed snapshot, not a fresh read
    steps = [stats for stats in received if stats.step is not None]
    # Each model step arrives once and in order: its sequence number grows by one.
    numbers = [stats.num_steps for stats in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert len(set(map(id, received))) == len(received)  # no snapshot delivered twice
    assert last.num_generation_tokens == NUM_REQUESTS * MAX_TOKENS
    assert (last.num_running, last.num_waiting, last.num_leaked_blocks) == (0, 0, 0)
    assert last.num_free_blocks + last.num_cached_blocks == last.num_total_blocks == 64
    text = metrics.render().decode()
    assert _histogram_count(text, "kvshare_step_duration_seconds") == len(steps)
    assert _histogram_count(text, "kvshare_batch_size") == len(steps)
    batch_sum = re.search(r"^kvshare_batch_size_sum (\S+)$", text, re.MULTILINE)
    assert batch_sum and float(batch_sum.group(1)) == sum(s.step.num_seqs for s in steps)
    assert (last.num_lookahead_steps > 0) == (async_scheduling == "on")


async def test_an_abort_reaches_a_stream_whose_next_step_is_in_flight(make_tiny_model) -> None:
    """Async scheduling: the engine thread applies an abort between two steps while a
    lookahead step is queued; the stream ends there and nothing stays held."""
    config = EngineConfig(
        model=str(make_tiny_model()), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
        async_scheduling="on",
    )  # fmt: skip
    engine = await started_async_engine(config)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    request = EngineRequest("long", [5, 9, 17, 33, 4], params)
    admitted = await asyncio.to_thread(engine.admit, request)
    received, reasons = 0, []
    async for output in engine.generate(admitted):
        received += sum(len(choice.new_token_ids) for choice in output.outputs)
        reasons += [c.finish_reason for c in output.outputs if c.finish_reason is not None]
        if received == 5:
            await engine.abort("long")
    await asyncio.sleep(0.6)  # the idle engine publishes again
    await engine.shutdown()
    last = engine.stats()
    assert 5 <= received < 200 and [r.value for r in reasons] == ["abort"]
    assert last.num_lookahead_steps > 0
    assert (last.num_running, last.num_leaked_blocks) == (0, 0)
    assert last.num_free_blocks + last.num_cached_blocks == last.num_total_blocks


@pytest.mark.parametrize(
    ("error", "logs_traceback"),
    [
        (ModelNotFoundError("model path '/nowhere' does not exist"), False),  # refused on purpose
        (ValueError("/m.gguf does not start with the GGUF magic bytes"), True),  # a library's
    ],
    ids=["engine-error", "other-error"],
)
async def test_a_load_failure_is_one_line_and_a_traceback_only_when_unexpected(
    error: Exception, logs_traceback: bool, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(config: EngineConfig):
        raise error

    engine = AsyncEngine(EngineConfig(), engine_factory=fail)
    await engine.start()
    await asyncio.to_thread(engine._thread.join, 5.0)
    assert engine.load_error == f"{type(error).__name__}: {error}"
    assert not engine.is_ready
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == (1 if logs_traceback else 0)
