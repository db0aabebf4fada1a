"""Sampler: greedy, counter-based seeded draws, filters, penalties, bias, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.batch import SampleSpec
from engine.core.sampling_params import SamplingParams
from engine.core.seeds import GOLDEN_GAMMA, MAX_SEED, draw_key, mix64
from engine.runtime.sampler import Sampler, counter_uniforms

pytestmark = pytest.mark.usefixtures("single_thread")

EOS = 2
PROBS = [0.5, 0.3, 0.15, 0.05]


def spec(seed=0, t=0, prompt=(), output=(), seeds=None, **params) -> SampleSpec:
    return SampleSpec(
        sampling_params=SamplingParams(**params),
        seeds=list(seeds) if seeds is not None else [seed],
        output_index=t,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
    )


def tokens(result) -> list[int]:
    return [row[0].token_id for row in result]


def fixed_logits(rows: int) -> torch.Tensor:
    return torch.tensor(PROBS).log().expand(rows, -1).clone()


def counts(draws: list[int]) -> list[int]:
    return [draws.count(v) for v in range(len(PROBS))]


def test_greedy_is_argmax():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    result = Sampler([EOS])(logits, [spec(temperature=0.0) for _ in range(5)])
    assert tokens(result) == logits.argmax(-1).tolist()


def test_an_injected_argmax_picks_the_greedy_rows_and_none_falls_back_to_torch():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    specs = [spec(temperature=0.0), spec(seed=3, temperature=1.0)] * 2
    plain = tokens(Sampler([EOS])(logits, specs))
    # A stand-in that answers like torch but counts its calls; seeded rows still draw.
    calls = []
    counted = Sampler([EOS], argmax=lambda x: calls.append(x.shape) or x.argmax(dim=-1))
    assert tokens(counted(logits, specs)) == plain and calls == [(4, 40)]
    declining = Sampler([EOS], argmax=lambda x: None)
    assert tokens(declining(logits, specs)) == plain
    assert plain[0] == logits[0].argmax().item() and plain[2] == logits[2].argmax().item()


@pytest.mark.parametrize(
    ("params", "taken"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "max_tokens": 3}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.0, "logprobs": 0}, False),
        ({"temperature": 0.0, "logit_bias": {3: 5.0}}, False),
        ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0.0, "presence_penalty": 0.5}, False),
        ({"temperature": 0.0, "min_tokens": 2}, False),
    ],
)
def test_only_plain_greedy_draws_are_their_rows_argmax(params: dict, taken: bool):
    """by_argmax takes specs whose __call__ tokens are each row's argmax of the raw logits,
    and gives the same result from the argmax alone (a second seed's draw included)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    specs = [spec(temperature=0.0), spec(seeds=[1, 2], **params), spec(temperature=0.0)]
    sampler = Sampler([EOS])
    from_argmax = sampler.by_argmax(specs, lambda: logits.argmax(dim=-1))
    assert (from_argmax is not None) is taken
    if taken:
        full = sampler(logits, specs)
        assert [[t.token_id for t in row] for row in from_argmax] == [
            [t.token_id for t in row] for row in full
        ]
        assert [len(row) for row in from_argmax] == [1, 2, 1]


def test_tensor_hash_matches_python_reference():
    """The tensor splitmix64 in the sampler against engine/core/seeds.py's mix64, bit for bit:
    keys with the top bit set (negative as int64) and token ids near 2**31 included."""
    keys = [draw_key(0, 0), draw_key(MAX_SEED, 7), draw_key(12345, 10**6), 2**64 - 1, 2**63]
    token_ids = torch.tensor([0, 1, 2, 3, 2**31 - 1]).expand(len(keys), 5)
    uniforms = counter_uniforms(keys, token_ids)
    for i, key in enumerate(keys):
        for j, v in enumerate(token_ids[i].tolist()):
            z = mix64(key + (v + 1) * GOLDEN_GAMMA)
            assert uniforms[i, j].item() == ((z >> 11) + 0.5) * 2.0**-53
    assert uniforms.min().item() > 0.0 and uniforms.max().item() < 1.0


def test_seeded_draw_ignores_batch_composition_order_and_global_rng():
    sampler = Sampler([EOS])
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    alone = tokens(sampler(row, [spec(seed=42, t=5)]))[0]
    others = torch.randn(3, 64)
    batch = torch.cat([others[:2], row, others[2:]])
    specs = [spec(seed=1, t=0), spec(seed=42, t=9, top_k=5), spec(seed=42, t=5), spec(seed=7)]
    torch.manual_seed(999)
    assert tokens(sampler(batch, specs))[2] == alone


def test_draws_differ_across_output_index_and_seed():
    logits = torch.zeros(1, 1000)  # uniform: the token is the argmax of the uniforms
    sampler = Sampler([EOS])
    by_t = [tokens(sampler(logits, [spec(seed=3, t=t)]))[0] for t in range(8)]
    by_seed = [tokens(sampler(logits, [spec(seed=s, t=0)]))[0] for s in range(8)]
    assert len(set(by_t)) >= 7 and len(set(by_seed)) >= 7
    assert tokens(sampler(logits, [spec(seed=3, t=4)]))[0] == by_t[4]


def test_distribution_matches_probabilities():
    num = 4000
    draws = tokens(Sampler([EOS])(fixed_logits(num), [spec(seed=s) for s in range(num)]))
    observed = counts(draws)
    chi_square = sum((o - num * p) ** 2 / (num * p) for o, p in zip(observed, PROBS, strict=True))
    assert chi_square < 16.27  # the 99.9% quantile of chi-square with 3 degrees of freedom


def test_temperature_sharpens_the_distribution():
    num = 2000
    specs = [spec(seed=s, temperature=0.25) for s in range(num)]
    observed = counts(tokens(Sampler([EOS])(fixed_logits(num), specs)))
    # p^4 normalised: token 0 gets 0.5^4 / (0.5^4 + 0.3^4 + ...) ~ 0.88.
    assert 0.84 * num < observed[0] < 0.92 * num


def test_top_k_one_equals_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    result = Sampler([EOS])(logits, [spec(seed=s, top_k=1, temperature=1.5) for s in range(6)])
    assert tokens(result) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7 keeps token 1; 0.8 >= 0.7 drops token 2
        ({"top_p": 0.9}, {0, 1, 2}),
        ({"min_p": 0.35}, {0, 1}),  # threshold 0.35 * 0.5 = 0.175
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
    ],
)
def test_filters_restrict_the_support(params, allowed):
    num = 600
    observed = counts(
        tokens(Sampler([EOS])(fixed_logits(num), [spec(seed=s, **params) for s in range(num)]))
    )
    assert {v for v, c in enumerate(observed) if c} == allowed


def test_filters_apply_per_row():
    specs = [spec(seed=s, top_k=1 if s % 2 else -1) for s in range(400)]
    draws = tokens(Sampler([EOS])(fixed_logits(400), specs))
    assert set(draws[1::2]) == {0} and set(draws[0::2]) == {0, 1, 2, 3}


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = spec(
        prompt=[0],
        output=[1, 1, 3],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    processed = Sampler([EOS]).processed_logits(logits, [row])
    # repetition (prompt+output {0,1,3}): 2 -> 1, -1 -> -2, 3 -> 1.5;
    # then output counts {1: 2, 3: 1}: -2 - 2*0.25 - 0.5 = -3, 1.5 - 0.25 - 0.5 = 0.75.
    assert processed.tolist() == [[1.0, -3.0, 0.5, 0.75, -2.0]]


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    sampler = Sampler([EOS])
    assert tokens(sampler(logits, [spec(temperature=0.0, logit_bias={0: 6.0})])) == [0]
    assert tokens(sampler(logits, [spec(temperature=0.0, logit_bias={1: -100.0})])) == [3]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 3.0]])  # EOS=2 is the argmax, then 3
    sampler = Sampler([EOS])
    early = spec(temperature=0.0, t=1, min_tokens=3, stop_token_ids=(3,))
    assert tokens(sampler(logits, [early])) == [4]
    reached = spec(temperature=0.0, t=3, min_tokens=3, stop_token_ids=(3,))
    assert tokens(sampler(logits, [reached])) == [2]
    ignoring_eos = spec(temperature=0.0, t=0, min_tokens=3, ignore_eos=True)
    assert tokens(sampler(logits, [ignoring_eos])) == [2]


@pytest.mark.parametrize(
    "params",
    [
        {"logit_bias": {3: 20.0}},
        {"min_tokens": 2, "stop_token_ids": (3,)},
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.0},
        {"frequency_penalty": 0.5},
        {},  # nothing applies: the logits go through as they are
    ],
)
def test_the_callers_logits_are_never_written(params):
    """Each stage that changes logits works on a copy; the model's own logits (and the
    logprobs computed from them) stay as they were, with a plain row in the same batch."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    specs = [spec(temperature=0.0, output=[3, 5], logprobs=2, **params), spec(seed=4)]
    first = Sampler([EOS])(logits, specs)[0][0]
    assert torch.equal(logits, before)
    expected = torch.log_softmax(before[0], dim=-1)
    assert math.isclose(first.logprob, expected[first.token_id].item(), rel_tol=1e-6)
    processed = Sampler([EOS]).processed_logits(logits, specs)
    assert torch.equal(logits, before)
    assert torch.equal(processed[1], before[1])  # the plain row: unchanged
    assert torch.equal(processed[0], before[0]) == (params == {})


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    specs = [spec(seed=1, logprobs=3, logit_bias={0: 50.0}), spec(temperature=0.0, logprobs=0)]
    first, second = (row[0] for row in Sampler([EOS])(logits, specs))
    expected = torch.log_softmax(logits, dim=-1)
    assert first.token_id == 0  # the bias decided the draw but not the reported logprobs
    assert math.isclose(first.logprob, expected[0, 0].item(), rel_tol=1e-6)
    top = expected[0].topk(3)
    assert [t for t, _ in first.top_logprobs] == top.indices.tolist()
    assert [v for _, v in first.top_logprobs] == pytest.approx(top.values.tolist(), rel=1e-6)
    assert second.token_id == int(logits[1].argmax())
    assert math.isclose(second.logprob, expected[1].max().item(), rel_tol=1e-6)
    assert second.top_logprobs == []


def test_no_logprobs_unless_asked():
    result = Sampler([EOS])(torch.randn(1, 10), [spec(seed=0)])
    assert result[0][0].logprob is None and result[0][0].top_logprobs == []


def test_one_token_per_seed_each_as_if_alone():
    logits = torch.zeros(2, 500)
    sampler = Sampler([EOS])
    result = sampler(logits, [spec(seeds=[11, 12, 13], t=0), spec(seed=5, t=2)])
    assert [len(row) for row in result] == [3, 1]
    for seed, token in zip([11, 12, 13], result[0], strict=True):
        assert token.token_id == tokens(sampler(logits[:1], [spec(seed=seed)]))[0]
    assert result[1][0].token_id == tokens(sampler(logits[:1], [spec(seed=5, t=2)]))[0]


def reference_draw(row: torch.Tensor, params: SamplingParams, seed: int, t: int) -> int:
    """Filters by a full sort, then the race over the whole vocabulary, one row at a time."""
    scaled = row / params.temperature
    order = scaled.argsort(descending=True)
    kept = torch.zeros_like(scaled, dtype=torch.bool)
    kept[order[: params.top_k if params.top_k != -1 else len(row)]] = True
    probs = scaled.masked_fill(~kept, float("-inf")).softmax(-1)
    sorted_probs = probs[order]
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    if params.top_p < 1.0:
        probs[order[mass_before >= params.top_p]] = 0.0
    probs[probs < params.min_p * probs.max()] = 0.0
    uniforms = counter_uniforms([draw_key(seed, t)], torch.arange(len(row))[None])[0]
    return int((probs.double() / -uniforms.log()).argmax())


@pytest.mark.parametrize("first_candidates", [2, 256, 5000])
def test_truncated_sampling_equals_a_full_sort_reference(first_candidates, monkeypatch):
    monkeypatch.setattr("engine.runtime.sampler._FIRST_CANDIDATES", first_candidates)
    vocab = 5000
    gen = torch.Generator().manual_seed(6)
    # Flat rows (nucleus of thousands of tokens) and peaky rows (a handful).
    logits = torch.cat(
        [0.1 * torch.randn(16, vocab, generator=gen), 4 * torch.randn(8, vocab, generator=gen)]
    )
    settings = [
        {"top_p": 0.9},
        {"top_p": 0.5, "temperature": 0.7},
        {"top_k": 40},
        {"top_k": 50, "top_p": 0.95},
        {"top_p": 0.8, "min_p": 0.5},
        {"temperature": 1.3},
        {"min_p": 0.2},
        {"top_k": 1},
    ]
    specs = [spec(seed=100 + i, t=i, **settings[i % 8]) for i in range(24)]
    result = tokens(Sampler([EOS])(logits, specs))
    expected = [
        reference_draw(logits[i], s.sampling_params, s.seeds[0], s.output_index)
        for i, s in enumerate(specs)
    ]
    assert result == expected
