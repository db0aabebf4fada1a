"""Speculative decoding (n-gram prompt lookup) on SmolLM2: the same greedy token ids as
decoding without it, offline and over HTTP, with the acceptance counters exported."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode import workloads
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

OUTPUT_LEN = 48


@pytest.fixture(scope="module")
def edit_prompts(model_dir) -> list[list[int]]:
    """Two "rewrite this code with a small change" chats: answers that copy the prompt."""
    from transformers import AutoTokenizer

    return workloads(AutoTokenizer.from_pretrained(model_dir), 2)["edit"]


def generate(model_dir: str, prompts, enable_prefix_cache: bool, **spec) -> tuple[list, object]:
    config = EngineConfig(
        model=model_dir, dtype="float32", enable_prefix_cache=enable_prefix_cache, **spec
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    results = engine.generate(prompts, params)
    engine.scheduler.check_integrity()
    assert engine.stats().num_leaked_blocks == 0 and engine.scheduler.num_running == 0
    return [r.token_ids[0] for r in results], engine.stats()


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_greedy_tokens_equal_without_speculation(model_dir, edit_prompts, enable_prefix_cache):
    plain, _ = generate(model_dir, edit_prompts, enable_prefix_cache)
    spec = dict(speculative_ngram_tokens=4, speculative_ngram_min=2, speculative_ngram_max=4)
    tokens, stats = generate(model_dir, edit_prompts, enable_prefix_cache, **spec)
    assert tokens == plain
    assert stats.num_spec_accepted_tokens > 0  # the copied code was drafted and kept


def test_over_http_the_counters_move_and_the_text_is_the_same(client, model, edit_prompts):
    body = dict(model=model, prompt=edit_prompts[0], max_tokens=OUTPUT_LEN, temperature=0)
    expected = client.completions.create(**body).choices[0].text  # the shared server: off
    import openai

    with running_server("--speculative-ngram-tokens", "4") as url:
        spec_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert spec_client.completions.create(**body).choices[0].text == expected
        metrics = scrape(url)
    assert metrics["kvshare_spec_draft_tokens_total"] > 0
    assert (
        0
        < metrics["kvshare_spec_accepted_tokens_total"]
        <= (metrics["kvshare_spec_draft_tokens_total"])
    )
    ratio = (
        metrics["kvshare_spec_accepted_tokens_total"] / metrics["kvshare_spec_draft_tokens_total"]
    )
    assert metrics["kvshare_spec_acceptance_ratio"] == pytest.approx(ratio)
