"""Our paged Gemma 3 against transformers' Gemma3ForCausalLM on the same (tiny random) weights.

The tiny model has a window of 8 positions on two of its three layers and blocks of 8 slots,
so prompts of 9 to 40 tokens cross the window, end on and one past block edges, and reach
their early positions only through the global layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from engine.core.batch import ScheduledSeq
from engine.runtime.loader import resolve_max_model_len
from engine.runtime.models.gemma3 import Gemma3ForCausalLM, Gemma3Layout
from tests.engine.runtime.test_llama_model import Paged, hf_logits
from tests.oracle import random_prompt

pytestmark = pytest.mark.usefixtures("single_thread")

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def gemma_dir(make_tiny_model):
    return make_tiny_model("gemma3")


@pytest.mark.parametrize("length", [8, 9, 16, 17, 29])
def test_a_prompt_crossing_the_window_matches_hf(length, gemma_dir, make_step):
    ids = random_prompt(length, seed=length)
    paged = Paged(gemma_dir)
    assert isinstance(paged.loaded.model, Gemma3ForCausalLM)
    ours = paged.run(make_step, [ScheduledSeq(0, ids, 0, [5, 2, 9, 11])])
    torch.testing.assert_close(ours, hf_logits(gemma_dir, ids), **TOLERANCE)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"sliding_window": 5, "num_key_value_heads": 1},  # a window inside a block; MQA
        {"sliding_window": 64},  # wider than every prompt: all layers see everything
        {"final_logit_softcapping": 3.0},
    ],
    ids=["untied", "window-5-mqa", "window-past-prompt", "softcap"],
)
def test_variants_match_hf(overrides, make_tiny_model, make_step):
    model_dir = make_tiny_model("gemma3", **overrides)
    ids = random_prompt(23, seed=7)
    ours = Paged(model_dir).run(make_step, [ScheduledSeq(0, ids, 0, [3, 0, 6])])
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), **TOLERANCE)


@pytest.mark.parametrize("cut", [3, 8, 11, 16])
def test_chunked_prefill_across_the_window_matches_hf(cut, gemma_dir, make_step):
    ids = random_prompt(30, seed=1)
    paged, table = Paged(gemma_dir), [7, 3, 12, 1]
    first = paged.run(make_step, [ScheduledSeq(0, ids[:cut], 0, table[: -(-cut // 8)])])
    rest = paged.run(make_step, [ScheduledSeq(0, ids[cut:], cut, table)])
    torch.testing.assert_close(torch.cat([first, rest]), hf_logits(gemma_dir, ids), **TOLERANCE)


def test_decodes_past_the_window_beside_a_prefill_match_hf(gemma_dir, make_step):
    a, b = random_prompt(21, seed=2), random_prompt(12, seed=3)
    paged = Paged(gemma_dir)
    paged.run(make_step, [ScheduledSeq(0, a[:14], 0, [0, 1])])
    rows = []
    for pos in range(14, 21):  # one token a step, the window sliding over block edges
        seqs = [ScheduledSeq(0, a[pos : pos + 1], pos, [0, 1, 2])]
        if pos == 17:
            seqs.append(ScheduledSeq(1, b, 0, [4, 5]))
        logits = paged.run(make_step, seqs, num_decodes=1)
        rows.append(logits[0])
        if pos == 17:
            torch.testing.assert_close(logits[1:], hf_logits(gemma_dir, b), **TOLERANCE)
    torch.testing.assert_close(torch.stack(rows), hf_logits(gemma_dir, a)[14:], **TOLERANCE)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_cpu_weights_still_match_hf(gemma_dir, make_step):
    ids = random_prompt(19, seed=4)
    paged = Paged(gemma_dir)
    paged.loaded.model.pack_for_cpu()
    assert not any(isinstance(m, torch.nn.Linear) for m in paged.loaded.model.modules())
    ours = paged.run(make_step, [ScheduledSeq(0, ids, 0, [4, 1, 6])])
    torch.testing.assert_close(ours, hf_logits(gemma_dir, ids), **TOLERANCE)


def test_the_context_is_the_models_own_not_the_window(gemma_dir):
    config = AutoConfig.from_pretrained(gemma_dir)
    assert config.sliding_window < config.max_position_embeddings
    assert resolve_max_model_len(config, None) == config.max_position_embeddings


def test_layout_reads_windows_scale_and_both_ropes(gemma_dir):
    layout = Gemma3Layout.from_hf_config(AutoConfig.from_pretrained(gemma_dir))
    assert layout.windows == (8, 8, None) and layout.local == (True, True, False)
    assert layout.attention_scale == 24**-0.5
    assert layout.local_rope.rope_parameters["rope_theta"] == 10_000.0
    assert layout.global_rope.rope_parameters["rope_theta"] == 1_000_000.0


def test_bfloat16_forward_tracks_hf_bfloat16(gemma_dir, make_step):
    ids = random_prompt(24, seed=5)
    paged = Paged(gemma_dir, dtype=torch.bfloat16)
    norms = [m for m in paged.loaded.model.modules() if type(m).__name__ == "Gemma3RMSNorm"]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)  # (1 + w) unrounded
    ours = paged.run(make_step, [ScheduledSeq(0, ids, 0, [0, 1, 2])])
    theirs = hf_logits(gemma_dir, ids, dtype=torch.bfloat16)
    exact = hf_logits(gemma_dir, ids)
    # bf16 rounding moves Gemma's logits by up to ~0.9 here (its norms after each block amplify
    # it): ours may stray from the float32 logits no further than transformers' bf16 does.
    assert (ours - exact).abs().max() <= 1.25 * (theirs - exact).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_an_activation_other_than_gelu_tanh_is_refused(make_tiny_model):
    config = AutoConfig.from_pretrained(make_tiny_model("gemma3"))
    config.hidden_activation = "silu"
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        Gemma3Layout.from_hf_config(config)
