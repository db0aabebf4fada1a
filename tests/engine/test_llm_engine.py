"""LLMEngine end to end on a tiny random Llama: outputs equal HF `generate` (the oracle)."""

from __future__ import annotations

import random
import shutil

import pytest

from engine.core.errors import ParamError
from engine.core.protocol import EngineRequest, FinishReason
from engine.core.sampling_params import SamplingParams
from engine.core.validation import validate_request
from engine.llm_engine import LLMEngine
from tests.engine.engine_helpers import (
    GREEDY,
    MAX_LEN,
    VOCAB,
    assert_all_blocks_free,
    make_engine,
    random_prompts,
    run_checked,
)
from tests.oracle import hf_greedy

# tiny_model_dir and hf_model: tests/engine/conftest.py


@pytest.mark.skipif(shutil.which("g++") is None, reason="the native kernel needs g++")
def test_these_scenarios_run_the_native_cpu_kernels(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    backend = engine.runner.attn_backend
    assert backend.name == "cpu"
    calls = []
    kernel = backend._decode_fn
    monkeypatch.setattr(backend, "_decode_fn", lambda *args: calls.append(args) or kernel(*args))
    fused = engine.runner.model.model.layers[0].mlp.fused
    assert fused is not None  # RMSNorm, SiLU-and-mul and rope run fused too
    covered = []
    silu_mul = fused.silu_mul
    monkeypatch.setattr(fused, "silu_mul", lambda x: covered.append(silu_mul(x)) or covered[-1])
    engine.generate(random_prompts(2, seed=3), GREEDY)
    assert len(calls) >= 11 * 2  # every decode step, in each of the 2 layers
    assert covered and all(out is not None for out in covered)


def test_one_prompt_matches_hf(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(1, seed=1)[0]
    result = engine.generate([prompt], GREEDY)[0]
    assert result.token_ids[0] == hf_greedy(hf_model, prompt, 12)
    assert result.finish_reasons == [FinishReason.LENGTH]
    assert_all_blocks_free(engine)


def test_sixteen_prompts_together_match_hf(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompts = random_prompts(16, seed=2)
    requests = {0: [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]}
    tokens = run_checked(engine, requests)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 12), f"prompt {i}"


def test_sixteen_prompts_staggered_match_hf(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompts = random_prompts(16, seed=3)
    requests: dict[int, list[EngineRequest]] = {}
    for i, prompt in enumerate(prompts):
        requests.setdefault(i * 2, []).append(EngineRequest(f"r{i}", prompt, GREEDY))
    tokens = run_checked(engine, requests)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 12), f"prompt {i}"


def test_preemption_keeps_outputs_equal(tiny_model_dir, hf_model):
    # 8 prompts of ~40 tokens + 24 outputs need ~32 blocks of 16; give the pool 12.
    engine = make_engine(tiny_model_dir, num_kv_blocks=12)
    prompts = random_prompts(8, seed=4, min_len=30, max_len=50)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {0: [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]}
    tokens = run_checked(engine, requests)
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 24), f"prompt {i}"


def test_chunked_prefill_keeps_outputs_equal(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    prompts = random_prompts(4, seed=5, min_len=50, max_len=90)
    requests = {0: [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]}
    prefill_chunks = []
    original_schedule = engine.scheduler.schedule

    def spy():
        out = original_schedule()
        prefill_chunks.extend(s.num_tokens for s in out.seqs[out.num_decodes :])
        assert out.num_batched_tokens <= 24
        return out

    engine.scheduler.schedule = spy
    tokens = run_checked(engine, requests)
    assert sum(prefill_chunks) >= sum(len(p) for p in prompts)
    assert len(prefill_chunks) > len(prompts)  # at least one prompt was split
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][0] == hf_greedy(hf_model, prompt, 12), f"prompt {i}"


def test_n4_seeded_forks_shares_blocks_and_is_reproducible(tiny_model_dir):
    prompt = random_prompts(1, seed=6, min_len=40, max_len=40)[0]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)

    def run_once() -> tuple[list[list[int]], list[int], int]:
        engine = make_engine(tiny_model_dir)
        engine.add_request(EngineRequest("fork", prompt, params))
        tokens = [[] for _ in range(4)]
        refcounts_after_fork = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                for choice in output.outputs:
                    tokens[choice.index].extend(choice.new_token_ids)
            seqs = engine.scheduler.live_sequences()
            if refcounts_after_fork is None and len(seqs) == 4:
                first_blocks = seqs[0].block_ids[:2]
                assert all(s.block_ids[:2] == first_blocks for s in seqs)
                pool = engine.kv_cache_manager.pool
                refcounts_after_fork = [pool.refcount(b) for b in first_blocks]
            engine.scheduler.check_integrity()
        assert_all_blocks_free(engine)
        return tokens, refcounts_after_fork, engine.stats().num_cow_copies

    tokens, refcounts, cow_copies = run_once()
    assert refcounts == [5, 5]  # 4 choices + the prefix tree (the prompt's full blocks)
    assert cow_copies >= 3  # the partial prompt block, once per writer but the last
    assert all(len(t) == 10 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the choices differ
    again, _, _ = run_once()
    assert again == tokens


def test_seeded_request_same_alone_and_in_a_crowd(tiny_model_dir):
    prompt = random_prompts(1, seed=7)[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = run_checked(make_engine(tiny_model_dir), {0: [EngineRequest("me", prompt, params)]})

    crowd: dict[int, list[EngineRequest]] = {}
    rng = random.Random(8)
    for i, other in enumerate(random_prompts(15, seed=9)):
        other_params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([-1, 5]),
            max_tokens=rng.randint(4, 20),
            ignore_eos=True,
        )
        crowd.setdefault(i % 3, []).append(EngineRequest(f"o{i}", other, other_params))
    crowd.setdefault(1, []).append(EngineRequest("me", prompt, params))
    together = run_checked(make_engine(tiny_model_dir, max_num_batched_tokens=64), crowd)
    assert together["me"] == alone["me"]


def test_abort_and_fault_free_everything(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompts = random_prompts(4, seed=10)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
    engine.step()
    aborted = engine.abort_request("r1")
    assert aborted and aborted[0].finished
    assert aborted[0].outputs[0].finish_reason == FinishReason.ABORT

    real_launch = engine.runner.launch
    engine.runner.launch = lambda out, previous=None: (_ for _ in ()).throw(
        RuntimeError("injected")
    )
    failed = engine.step()
    engine.runner.launch = real_launch
    assert {o.request_id for o in failed} == {"r0", "r2", "r3"}
    assert all(o.finished and o.error and "injected" in o.error for o in failed)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
    # The engine still serves after the fault.
    result = engine.generate([prompts[0]], GREEDY)[0]
    assert result.token_ids[0] == hf_greedy(hf_model, prompts[0], 12)


@pytest.mark.parametrize(
    ("make_request", "param", "message"),
    [
        (lambda: EngineRequest("x", [], GREEDY), "prompt", "prompt must not be empty"),
        (
            lambda: EngineRequest("x", [5] * MAX_LEN, GREEDY),
            "prompt",
            f"prompt has {MAX_LEN} tokens but the model's context window is {MAX_LEN} tokens",
        ),
        (
            lambda: EngineRequest("x", [5, VOCAB], GREEDY),
            "prompt",
            f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
        ),
        (lambda: EngineRequest("x", [5, -1], GREEDY), "prompt", "token id -1 is outside"),
        (lambda: EngineRequest("x", [5], SamplingParams(max_tokens=-1)), "max_tokens", None),
        (lambda: EngineRequest("x", [5], SamplingParams(temperature=-0.1)), "temperature", None),
        (lambda: EngineRequest("x", [5], SamplingParams(top_p=0.0)), "top_p", None),
        (lambda: EngineRequest("x", [5], SamplingParams(top_p=1.5)), "top_p", None),
        (lambda: EngineRequest("x", [5], SamplingParams(n=0)), "n", None),
        (
            lambda: EngineRequest("x", [5], SamplingParams(logit_bias={VOCAB: 1.0})),
            "logit_bias",
            None,
        ),
        (
            lambda: EngineRequest("x", [5], SamplingParams(stop_token_ids=(VOCAB,))),
            "stop_token_ids",
            None,
        ),
    ],
)
def test_bad_input_is_refused_and_leaks_nothing(tiny_model_dir, make_request, param, message):
    """LLMEngine.add_request is the offline edge: it validates (engine/core/validation.py)."""
    engine = _shared_engine(tiny_model_dir)
    with pytest.raises(ParamError) as info:
        engine.add_request(make_request())
    assert info.value.param == param
    assert (message or param) in info.value.message  # a field error names its field
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_a_request_is_checked_once_when_admitted_and_not_again_when_queued(
    tiny_model_dir, monkeypatch
):
    """AsyncEngine's path: admit() (a worker thread) checks the request, add_admitted() (the
    engine thread) only queues it; the offline add_request() is both, checking once."""
    engine = _shared_engine(tiny_model_dir)
    calls = []
    monkeypatch.setattr(
        "engine.llm_engine.validate_request",
        lambda *args, **kwargs: calls.append(args[0]) or validate_request(*args, **kwargs),
    )
    edge, offline = EngineRequest("edge", [5, 6], GREEDY), EngineRequest("offline", [7], GREEDY)
    admitted = engine.admit(edge, "messages")
    assert (admitted.request, admitted.grammar, calls) == (edge, None, [edge])
    engine.add_admitted(admitted)
    engine.add_request(offline)
    assert calls == [edge, offline]
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_admit_names_the_prompt_field_it_is_given(tiny_model_dir):
    engine = _shared_engine(tiny_model_dir)
    with pytest.raises(ParamError) as info:
        engine.admit(EngineRequest("empty", [], GREEDY), "messages")
    assert info.value.param == "messages"
    assert not engine.has_unfinished_requests()


_ENGINES: dict[str, LLMEngine] = {}


def _shared_engine(model_dir: str) -> LLMEngine:
    if model_dir not in _ENGINES:
        _ENGINES[model_dir] = make_engine(model_dir)
    return _ENGINES[model_dir]


def test_unknown_model_path_is_refused(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception, match="no-such-model"):
        make_engine(str(missing))


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(Exception, match="GPT2LMHeadModel") as info:
        make_engine(str(tmp_path))
    assert "LlamaForCausalLM" in str(info.value)  # the message lists what is supported
