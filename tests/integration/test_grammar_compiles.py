"""Grammar compiles are bounded per tenant and killed at their time limit (issue 55), on the
SmolLM2 vocabulary, where a 55-byte pattern takes seconds to compile."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import ModelInfo
from engine.core.sampling_params import StructuredOutput
from engine.runtime.grammar import GrammarCache, schema_text
from engine.runtime.grammar_compiles import GrammarCompiles

TIMEOUT_S = 1.0
QUICK_S = 0.6  # a small schema's compile, waiting for a free worker included, stays under this


def slow_schema(variant: int) -> StructuredOutput:
    """About 7 s to compile on SmolLM2's vocabulary (2-core AMD EPYC Zen 4)."""
    pattern = f"(([a-z]{{1,30}}[0-9]{{1,30}}){{1,30}}){{1,{10 + variant}}}"
    return StructuredOutput("json_schema", schema_text({"type": "string", "pattern": pattern}))


def quick_schema(variant: int) -> StructuredOutput:
    return StructuredOutput("json_schema", schema_text({"type": "integer", "maximum": variant}))


@pytest.fixture
def cache(model_dir):
    """A cache on its own compile host (so the process's shared one is not disturbed), the
    host started and the vocabulary registered before the test's clock runs."""
    info = ModelInfo("smollm2", model_dir, 2048, 49152, (2,), "v0")
    compiles = GrammarCompiles()
    cache = GrammarCache(info, EngineConfig(grammar_compile_timeout_seconds=TIMEOUT_S), compiles)
    cache.compile(quick_schema(-1))
    yield cache
    cache.close()
    compiles.close()


def timed_compile(cache: GrammarCache, structured: StructuredOutput, tenant: str) -> float:
    """Seconds until the compile returned or failed."""
    started = time.perf_counter()
    with contextlib.suppress(ParamError):
        cache.compile(structured, tenant, tenant)
    return time.perf_counter() - started


def in_threads(calls) -> list:
    results = [None] * len(calls)

    def run(index, call):
        results[index] = call()

    threads = [threading.Thread(target=run, args=item) for item in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_a_compile_past_its_limit_is_a_400_and_frees_its_worker(cache):
    """Slow schemas time out at the limit, and the workers they held are free at once: quick
    compiles right after finish quickly (a compile left running in a thread would hold its
    worker for seconds more)."""
    started = time.perf_counter()
    with pytest.raises(ParamError, match="grammar_compile_timeout_seconds") as error:
        cache.compile(slow_schema(1), "a", "a")
    assert error.value.param == "response_format"
    assert time.perf_counter() - started < TIMEOUT_S + 1.0
    slow = in_threads([lambda v=v: timed_compile(cache, slow_schema(v), "a") for v in (2, 3)])
    assert all(TIMEOUT_S - 0.05 < seconds < TIMEOUT_S + 1.0 for seconds in slow), slow
    assert cache.num_compile_failures == 3
    quick = in_threads([lambda v=v: timed_compile(cache, quick_schema(v), "b") for v in (1, 2)])
    assert max(quick) < QUICK_S, quick


def test_one_tenants_slow_compiles_never_hold_every_worker(cache):
    """Tenant A sends three slow schemas at once; tenant B's compile, sent just after, runs
    on the worker A may not take and finishes quickly."""
    threads = [
        threading.Thread(target=timed_compile, args=(cache, slow_schema(10 + v), "a"))
        for v in range(3)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.1)  # A's compiles are running or queued
    seconds = timed_compile(cache, quick_schema(7), "b")
    for thread in threads:
        thread.join(30)
    assert seconds < QUICK_S
    assert cache.num_compile_failures == 3  # all of A's timed out, B's compiled
