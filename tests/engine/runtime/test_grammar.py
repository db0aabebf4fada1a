"""Grammar compile (cache, limits, errors) and grammar masks on the tiny JSON tokenizer."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from engine.core.batch import SampleSpec
from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import ModelInfo
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.runtime.grammar import GrammarCache, GrammarMatchers, schema_text
from engine.runtime.sampler import Sampler
from tests.json_tokenizer import EOS_TOKEN_ID, build_json_tokenizer, json_vocab

VOCAB = 256  # the model's; the tokenizer has fewer ids: the rest is padding
BOOLEAN = StructuredOutput("json_schema", schema_text({"type": "boolean"}))


@pytest.fixture(scope="module")
def model_info(tmp_path_factory) -> ModelInfo:
    directory = build_json_tokenizer(tmp_path_factory.mktemp("json-tokenizer"))
    return ModelInfo("tiny", str(directory), 256, VOCAB, (EOS_TOKEN_ID,), "v0")


@pytest.fixture(scope="module")
def cache(model_info) -> GrammarCache:
    cache = GrammarCache(model_info, EngineConfig())
    yield cache
    cache.close()


def token_id(text: str) -> int:
    return json_vocab()[text]


def allowed_ids(matchers: GrammarMatchers, history: list[int], key=("r", 0)) -> set[int]:
    logits = torch.zeros(2, VOCAB)
    matchers.apply_masks(logits, [1], [key], [history])
    assert torch.equal(logits[0], torch.zeros(VOCAB)), "an unconstrained row was masked"
    return set(torch.nonzero(logits[1] == 0).flatten().tolist())


def test_compile_is_cached_and_counted(model_info):
    cache = GrammarCache(model_info, EngineConfig())
    first = cache.compile(BOOLEAN)
    assert cache.compile(StructuredOutput("json_schema", BOOLEAN.schema)) is first
    assert cache.num_cache_hits == 1
    assert len(cache.drain_compile_seconds()) == 1
    assert cache.drain_compile_seconds() == []
    cache.close()


def test_one_namespace_never_hits_another_s_compile(model_info):
    """A tenant's schema is compiled anew for another tenant (or salt): its hit (the time
    saved, the counter) would tell that tenant the schema was used."""
    cache = GrammarCache(model_info, EngineConfig())
    tenant_a = cache.compile(BOOLEAN, '["a", null]')
    tenant_b = cache.compile(BOOLEAN, '["b", null]')
    assert tenant_b is not tenant_a and cache.num_cache_hits == 0
    assert len(cache.drain_compile_seconds()) == 2  # both really compiled
    assert cache.compile(BOOLEAN, '["a", null]') is tenant_a and cache.num_cache_hits == 1
    cache.close()


def test_cache_is_lru_bounded(model_info):
    cache = GrammarCache(model_info, EngineConfig(grammar_cache_size=1))
    first = cache.compile(BOOLEAN)
    cache.compile(StructuredOutput("json_object"))  # evicts BOOLEAN
    assert cache.compile(BOOLEAN) is not first
    assert cache.num_cache_hits == 0
    cache.close()


def test_schema_over_the_size_cap_is_refused(model_info):
    cache = GrammarCache(model_info, EngineConfig(max_schema_bytes=32))
    schema = schema_text({"type": "object", "properties": {"a_long_name": {"type": "string"}}})
    with pytest.raises(ParamError, match="max_schema_bytes") as error:
        cache.compile(StructuredOutput("json_schema", schema))
    assert error.value.param == "response_format"
    cache.close()


def test_uncompilable_schema_is_a_param_error_and_not_cached(cache):
    bad = StructuredOutput("json_schema", schema_text({"$ref": "#/$defs/missing"}))
    for _ in range(2):
        with pytest.raises(ParamError, match="cannot be compiled") as error:
            cache.compile(bad)
        assert error.value.param == "response_format"
    assert cache.num_compile_failures >= 2


class StuckCompiles:
    """A compile host whose compiles never finish; remembers what was given up."""

    def __init__(self) -> None:
        self.given_up: list[Future] = []

    def register(self, info) -> int:
        return 0

    def submit(self, tokenizer_id, tenant, kind, text, timeout_s) -> Future:
        return Future()

    def give_up(self, future: Future) -> None:
        self.given_up.append(future)


def test_compile_time_out_is_a_param_error_and_gives_the_compile_up(model_info):
    compiles = StuckCompiles()
    config = EngineConfig(grammar_compile_timeout_seconds=0.05)
    cache = GrammarCache(model_info, config, compiles)  # type: ignore[arg-type]
    with pytest.raises(ParamError, match="grammar_compile_timeout_seconds") as error:
        cache.compile(BOOLEAN)
    assert error.value.param == "response_format"
    assert cache.num_compile_failures == 1
    assert len(compiles.given_up) == 1  # the host is told to kill it


@pytest.mark.parametrize(
    ("fields", "param"), [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 1}, "min_tokens")]
)
def test_fields_a_grammar_cannot_honour_are_refused(cache, fields, param):
    params = SamplingParams(structured=StructuredOutput("json_object"), **fields)
    with pytest.raises(ParamError) as error:
        cache.compile_for(params)
    assert error.value.param == param


def test_no_grammar_without_response_format(cache):
    assert cache.compile_for(SamplingParams()) is None


def test_mask_allows_exactly_the_grammar_and_eos_only_at_the_end(cache):
    matchers = GrammarMatchers(VOCAB)
    matchers.register("r", "json_schema", cache.compile(BOOLEAN))
    first = {token_id(t) for t in ("t", "f", "true", "false")}
    assert allowed_ids(matchers, []) == first  # no padding, no specials, no EOS yet
    assert allowed_ids(matchers, [token_id("t")]) == {token_id("r")}
    # The same history again is no replay; a longer one catches up.
    assert allowed_ids(matchers, [token_id("t")]) == {token_id("r")}
    assert allowed_ids(matchers, [token_id("true")], key=("r", 1)) == {EOS_TOKEN_ID}
    matchers.release(["r"])
    with pytest.raises(RuntimeError, match="no grammar"):
        allowed_ids(matchers, [])


def test_json_object_mask_starts_an_object(cache):
    matchers = GrammarMatchers(VOCAB)
    matchers.register("r", "json_object", cache.compile(StructuredOutput("json_object")))
    assert allowed_ids(matchers, []) == {token_id("{"), token_id('{"'), token_id("{}")}
    assert matchers.num_requests_by_kind == {"json_object": 1, "json_schema": 0, "tool_calls": 0}


def test_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs(cache):
    matchers = GrammarMatchers(VOCAB)
    matchers.register("r", "json_schema", cache.compile(BOOLEAN))
    logits = torch.zeros(2, VOCAB)
    logits[:, token_id("x")] = 10.0  # the model's favourite is not a boolean
    logits[:, token_id("f")] = 1.0
    spec = SampleSpec(SamplingParams(temperature=0.0, logprobs=0), [7], 0, [5], [])
    constrained = SampleSpec(
        SamplingParams(temperature=0.0, logprobs=0), [7], 0, [5], [], grammar_keys=[("r", 0)]
    )
    free, masked = Sampler([EOS_TOKEN_ID], matchers)(logits, [spec, constrained])
    assert free[0].token_id == token_id("x")
    assert masked[0].token_id == token_id("f")
    assert masked[0].logprob == pytest.approx(
        torch.log_softmax(logits[1], -1)[token_id("f")].item()
    )


def test_seeded_draws_stay_in_the_grammar(cache):
    matchers = GrammarMatchers(VOCAB)
    matchers.register("r", "json_schema", cache.compile(BOOLEAN))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    keys = [("r", i) for i in range(8)]
    spec = SampleSpec(SamplingParams(temperature=1.0, top_p=0.9), list(range(8)), 0, [5], [], keys)
    drawn = {token.token_id for token in Sampler([EOS_TOKEN_ID], matchers)(logits, [spec])[0]}
    assert drawn <= {token_id(t) for t in ("t", "f", "true", "false")}
