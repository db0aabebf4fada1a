"""echo + logprobs on /v1/completions over HTTP (real server, official openai client), against
HF's log-softmax on the same SmolLM2 weights at every prompt position.

The requests are what lm-eval-harness's `local-completions` sends for loglikelihood (token-id
prompts, echo, logprobs 1, max_tokens 1, temperature 0, seed 1234) and the older max_tokens 0.
A prompt already in the prefix cache must still be scored right, and report cached_tokens 0
(cached positions have no logits: it is recomputed); with the cache off too; prompts longer
than one prefill chunk (config/cpu.yaml: 512 tokens; the cache-off server: 64).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from benchmarks.questions import QUESTIONS
from tests.integration.server import running_server

pytestmark = pytest.mark.integration

ATOL = 2e-3  # fp32 logprobs; the packed / fused CPU kernels round differently from HF's
LONG_TEXT = " ".join(QUESTIONS * 5)  # ~690 tokens: two prefill chunks of 512
SHORT_TEXT = " ".join(QUESTIONS * 2)  # ~165 tokens: three chunks of 64


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def uncached_client() -> Iterator[openai.OpenAI]:
    """A second server: prefix cache off, 64-token prefill chunks."""
    with running_server("--no-prefix-cache", "--max-num-batched-tokens", "64") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: HF's log-softmax at positions 0 .. P - 2 (row i predicts ids[i + 1])."""
    with torch.inference_mode():
        logits = hf[0](torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_scored(hf, logprobs, ids: list[int], num_top: int) -> None:
    """The first len(ids) entries of a completions `logprobs` object score the prompt as HF."""
    expected = hf_logprobs(hf, ids)
    tokenizer = hf[1]
    assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]  # ASCII text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = torch.tensor(logprobs.token_logprobs[1 : len(ids)], dtype=torch.float32)
    want = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    top = expected.topk(num_top, dim=-1)
    for i, alternatives in enumerate(logprobs.top_logprobs[1 : len(ids)]):
        names = {tokenizer.decode([t]) for t in top.indices[i].tolist()}
        assert set(alternatives) == names, f"position {i}"
        values = torch.tensor(sorted(alternatives.values(), reverse=True))
        torch.testing.assert_close(values, top.values[i], atol=ATOL, rtol=0)
    offsets = logprobs.text_offset[: len(ids)]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def lm_eval_request(client, model, ids: list[int], max_tokens: int = 1):
    """lm-eval local-completions' loglikelihood payload (tokenized_requests=True)."""
    return client.completions.create(
        model=model,
        prompt=[ids],
        temperature=0,
        max_tokens=max_tokens,
        logprobs=1,
        seed=1234,
        echo=True,
    )


def test_a_cached_prompt_is_scored_like_hf_and_reports_no_cached_tokens(client, model, hf):
    ids = hf[1](LONG_TEXT)["input_ids"]
    assert len(ids) > 512  # longer than one prefill chunk of config/cpu.yaml
    client.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0)
    warm = client.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # the prompt is in the cache
    scored = lm_eval_request(client, model, ids)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    choice = scored.choices[0]
    assert_prompt_scored(hf, choice.logprobs, ids, num_top=1)
    assert len(choice.logprobs.tokens) == len(ids) + 1  # the prompt, then the one new token
    assert choice.text.startswith(hf[1].decode(ids))
    # Scoring inserted its blocks again: the next plain request reuses them.
    after = client.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens > 0


def test_lm_eval_loglikelihood_of_a_continuation(client, model, hf):
    tokenizer = hf[1]
    context = tokenizer("The capital of France is")["input_ids"]
    continuation = tokenizer(" Paris, a city on the Seine.")["input_ids"]
    ids = context + continuation
    choice = lm_eval_request(client, model, ids).choices[0]
    # lm-eval: sum(token_logprobs[ctxlen:-1]), greedy if each is the top alternative.
    ours = sum(choice.logprobs.token_logprobs[len(context) : -1])
    expected = hf_logprobs(hf, ids)
    targets = torch.tensor(continuation)
    rows = expected[len(context) - 1 : len(ids) - 1]
    assert ours == pytest.approx(rows.gather(1, targets[:, None]).sum().item(), abs=1e-2)
    greedy = [
        lp == max(top.values())
        for lp, top in zip(
            choice.logprobs.token_logprobs[len(context) : -1],
            choice.logprobs.top_logprobs[len(context) : -1],
            strict=True,
        )
    ]
    assert greedy == (rows.argmax(-1) == targets).tolist()


def test_max_tokens_0_echoes_and_scores_only_the_prompt(client, model, hf):
    text = SHORT_TEXT
    ids = hf[1](text)["input_ids"]
    response = client.completions.create(
        model=model, prompt=text, max_tokens=0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text == hf[1].decode(ids)
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert_prompt_scored(hf, choice.logprobs, ids, num_top=2)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(ids)


def test_without_the_cache_and_in_64_token_chunks(uncached_client, hf):
    model = uncached_client.models.list().data[0].id
    ids = hf[1](SHORT_TEXT)["input_ids"]
    assert len(ids) > 2 * 64
    for _ in range(2):  # the second time as the first: nothing is cached
        response = lm_eval_request(uncached_client, model, ids)
        assert response.usage.prompt_tokens_details.cached_tokens == 0
        assert_prompt_scored(hf, response.choices[0].logprobs, ids, num_top=1)


def test_streamed_echo_comes_first_with_the_prompt_logprobs(client, model, hf):
    ids = hf[1](SHORT_TEXT)["input_ids"]
    params = dict(model=model, prompt=[ids], max_tokens=4, logprobs=1, echo=True, temperature=0)
    whole = client.completions.create(**params).choices[0]
    chunks = [c for c in client.completions.create(**params, stream=True) if c.choices]
    first = chunks[0].choices[0]
    assert first.text == hf[1].decode(ids)
    assert len(first.logprobs.tokens) == len(ids)
    assert_prompt_scored(hf, first.logprobs, ids, num_top=1)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    assert offsets[len(ids)] == len(first.text)  # completion offsets count the echo


def test_n_choices_each_echo_the_scored_prompt(client, model, hf):
    ids = hf[1]("Once upon a time there was a lighthouse keeper")["input_ids"]
    response = client.completions.create(
        model=model, prompt=[ids], n=2, seed=3, max_tokens=3, logprobs=0, echo=True
    )
    for choice in response.choices:
        assert_prompt_scored(hf, choice.logprobs, ids, num_top=0)
        assert len(choice.logprobs.tokens) == len(ids) + 3


def test_echo_without_logprobs(client, model):
    response = client.completions.create(
        model=model, prompt="Hello there", max_tokens=3, temperature=0, echo=True
    )
    assert response.choices[0].text.startswith("Hello there")
    assert response.choices[0].logprobs is None
    empty = client.completions.create(model=model, prompt="Hello there", max_tokens=0, echo=True)
    assert empty.choices[0].text == "Hello there"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_combinations_get_a_400_naming_the_field(client, model, fields, param):
    body = {"logprobs": 1, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", echo=True, extra_body=body)
    assert info.value.body["param"] == param
