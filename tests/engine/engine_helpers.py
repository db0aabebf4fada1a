"""The tiny random Llama that the LLMEngine tests share (test_llm_engine, test_llm_engine_prefix,
audit/test_auditor), and helpers that build and drive an engine on it.

The fixtures over it (tiny_model_dir, hf_model) live in tests/engine/conftest.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

VOCAB = 256
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def save_tiny_llama(path: Path) -> str:
    """Save the tiny random Llama (seed 0) to `path`; returns it as a string."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # a head dim the native CPU decode kernel takes: these scenarios run it
        max_position_embeddings=MAX_LEN,
        initializer_range=0.2,  # peaky logits: no near-ties for argmax to flip on
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return str(path)


def load_hf_model(model_dir: str) -> LlamaForCausalLM:
    """The same weights in HF transformers, float32: the oracle's model."""
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_engine(model_dir: str, **overrides) -> LLMEngine:
    settings = dict(model=model_dir, dtype="float32", num_kv_blocks=128, max_num_seqs=32)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def random_prompts(num: int, seed: int, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)
    ]


def run_checked(engine: LLMEngine, requests: dict[int, list[EngineRequest]]) -> dict[str, list]:
    """Step until done, adding requests[k] before step k; check integrity after every step."""
    tokens: dict[str, list[list[int]]] = {}
    step = 0
    while step <= max(requests, default=0) or engine.has_unfinished_requests():
        for request in requests.get(step, []):
            engine.add_request(request)
            tokens[request.request_id] = [[] for _ in range(request.sampling_params.n)]
        for output in engine.step():
            assert output.error is None, output.error
            for choice in output.outputs:
                tokens[output.request_id][choice.index].extend(choice.new_token_ids)
        engine.scheduler.check_integrity()
        step += 1
    assert_all_blocks_free(engine)
    return tokens


def assert_all_blocks_free(engine: LLMEngine) -> None:
    """No sequence holds a block: each one is free or held by the prefix tree alone, and
    evicting the whole tree frees them all."""
    kv = engine.kv_cache_manager
    kv.check_integrity([])
    kv.evict(kv.num_total_blocks)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


async def started_async_engine(config: EngineConfig):
    """An AsyncEngine whose engine thread has loaded the model (fails the test otherwise)."""
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(config)
    await engine.start()
    for _ in range(600):
        if engine.is_ready or engine.load_error:
            break
        await asyncio.sleep(0.05)
    assert engine.is_ready, engine.load_error
    return engine
