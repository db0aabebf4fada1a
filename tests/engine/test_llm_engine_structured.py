"""Grammar-constrained decoding end to end: a tiny random Llama (vocab 256) with a byte-level
JSON tokenizer beside it, sampled at temperature 1.0. The oracle for "conforms" is
jsonschema.validate; each scenario checks integrity and that no block leaks."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import EngineRequest, FinishReason
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.llm_engine import GenerationResult, LLMEngine
from engine.runtime.grammar import schema_text
from tests.engine.engine_helpers import assert_all_blocks_free, started_async_engine
from tests.json_tokenizer import build_json_tokenizer, decode
from tests.tiny_models import build_tiny_hf_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "color"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            "n": {"type": "integer", "minimum": 0, "maximum": 20},
        },
        "required": ["tags", "n"],
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"x": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
                "required": ["x"],
            },
            "code": {"type": "string", "pattern": "^[a-c]{2}$"},
        },
        "required": ["inner", "code"],
    },
]
SEEDS = (0, 1, 2)
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (eos 2) with the JSON tokenizer saved next to it."""
    directory = tmp_path_factory.mktemp("tiny-llama-json")
    build_tiny_hf_model("llama").save_pretrained(directory)
    return build_json_tokenizer(directory)


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=32)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def constrained(schema: dict, seed: int, n: int = 3) -> SamplingParams:
    structured = StructuredOutput("json_schema", schema_text(schema))
    return SamplingParams(
        n=n, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=structured
    )


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Every schema with every seed; prompts share a prefix so the cache has hits."""
    cases = [(s, seed) for s in range(len(SCHEMAS)) for seed in SEEDS]
    prompts = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 50 + s, 60 + seed] for s, seed in cases]
    return prompts, [constrained(SCHEMAS[s], seed) for s, seed in cases]


def run(engine: LLMEngine, prompts, params) -> list[GenerationResult]:
    results = engine.generate(prompts, params)
    engine.scheduler.check_integrity()
    assert_all_blocks_free(engine)
    return results


def assert_conforms(model_dir: Path, results, params) -> None:
    for result, param in zip(results, params, strict=True):
        assert result.error is None, result.error
        schema = json.loads(param.structured.schema)
        for token_ids, reason in zip(result.token_ids, result.finish_reasons, strict=True):
            assert reason is FinishReason.STOP, decode(model_dir, token_ids)
            jsonschema.validate(json.loads(decode(model_dir, token_ids)), schema)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[GenerationResult]:
    """The whole workload in one batch on a roomy pool, prefix cache on."""
    prompts, params = workload()
    engine = make_engine(model_dir)
    results = run(engine, prompts, params)
    stats = engine.stats()
    assert stats.num_structured_json_schema_requests == len(prompts)
    assert stats.num_grammar_cache_hits == len(prompts) - len(SCHEMAS)
    assert stats.num_preemptions == 0
    return results


def test_async_scheduling_leaves_constrained_steps_synchronous(model_dir, reference):
    """A grammar masks a draw by the tokens before it, so no lookahead step runs while a
    constrained request does (engine/sched/lookahead.py): the same text as synchronous steps,
    every choice valid."""
    prompts, params = workload()
    engine = make_engine(model_dir, async_scheduling="on")
    results = run(engine, prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert_conforms(model_dir, results, params)
    assert engine.stats().num_lookahead_steps == 0


def test_every_choice_conforms_and_stops(model_dir, reference):
    _, params = workload()
    assert_conforms(model_dir, reference, params)
    outputs = {tuple(ids) for result in reference for ids in result.token_ids}
    assert len(outputs) > len(SCHEMAS)  # temperature 1.0 really samples different JSON


def test_same_seed_alone_gives_the_same_output(model_dir, reference):
    prompts, params = workload()
    engine = make_engine(model_dir)
    for i in (0, 4, 8):
        assert run(engine, [prompts[i]], [params[i]])[0].token_ids == reference[i].token_ids


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_preemption_and_prefix_cache_do_not_change_outputs(
    model_dir, reference, enable_prefix_cache
):
    prompts, params = workload()
    engine = make_engine(
        model_dir, num_kv_blocks=14, block_size=8, enable_prefix_cache=enable_prefix_cache
    )
    results = run(engine, prompts, params)
    assert engine.stats().num_preemptions > 0  # matchers survived recompute
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def test_json_object_mode_gives_an_object(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(
        n=2, temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput("json_object")
    )
    (result,) = run(engine, [[1, 5, 6, 7]], [params])
    for token_ids, reason in zip(result.token_ids, result.finish_reasons, strict=True):
        text = decode(model_dir, token_ids)
        if reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:  # greedy may run past max_tokens inside a string: still an object's start
            assert reason is FinishReason.LENGTH and text.startswith("{")
    assert engine.stats().num_structured_json_object_requests == 1


def test_a_grammar_error_or_time_out_fails_only_its_request(model_dir):
    engine = make_engine(model_dir)
    good = constrained(SCHEMAS[0], seed=5, n=1)
    bad = StructuredOutput("json_schema", schema_text({"$ref": "#/$defs/missing"}))
    with pytest.raises(ParamError) as error:
        engine.add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(structured=bad)))
    assert error.value.param == "response_format"
    with pytest.raises(ParamError) as error:
        engine.generate([[1, 4]], [SamplingParams(ignore_eos=True, structured=bad)])
    assert error.value.param == "ignore_eos"

    compiles, given_up = engine.grammar_cache._compiles, []
    stuck = SimpleNamespace(submit=lambda *args: Future(), give_up=given_up.append)
    engine.grammar_cache._compiles, engine.grammar_cache.timeout_s = stuck, 0.05
    slow = constrained({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, seed=1)
    with pytest.raises(ParamError, match="longer than") as error:
        engine.generate([[1, 4]], [slow])
    assert error.value.param == "response_format" and len(given_up) == 1
    engine.grammar_cache._compiles, engine.grammar_cache.timeout_s = compiles, 10.0

    (result,) = run(engine, [[1, 9, 9]], [good])
    assert_conforms(model_dir, [result], [good])
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.runner.grammar_matchers.num_live_requests <= 1
    engine.step()  # the finished request's grammar is released at the next step
    assert engine.runner.grammar_matchers.num_live_requests == 0
    assert engine.stats().num_grammar_compile_failures == 2


def test_async_engine_compiles_when_it_admits_and_runs_what_it_compiled(model_dir, monkeypatch):
    compiled = []

    async def scenario() -> list[int]:
        config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64)
        engine = await started_async_engine(config)
        cache = engine._engine.grammar_cache
        real = cache.compile_for
        monkeypatch.setattr(cache, "compile_for", lambda *a: compiled.append(a) or real(*a))
        bad = StructuredOutput("json_schema", schema_text({"$ref": "#/$defs/missing"}))
        with pytest.raises(ParamError):  # refused before anything is queued
            engine.admit(EngineRequest("bad", [1, 3], SamplingParams(structured=bad)))
        token_ids: list[int] = []
        request = EngineRequest("good", [1, 3], constrained(SCHEMAS[1], seed=3, n=1))
        admitted = await asyncio.to_thread(engine.admit, request)
        assert len(compiled) == 2 and admitted.grammar is not None
        async for output in engine.generate(admitted):
            assert output.error is None, output.error
            token_ids += output.outputs[0].new_token_ids if output.outputs else []
        assert len(compiled) == 2  # generate() compiles nothing
        await engine.shutdown()
        return token_ids

    token_ids = asyncio.run(scenario())
    jsonschema.validate(json.loads(decode(model_dir, token_ids)), SCHEMAS[1])
