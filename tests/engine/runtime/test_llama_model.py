"""Our paged Llama-family forward against transformers' forward on the same weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.batch import ScheduledSeq
from engine.core.config import EngineConfig
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu.linear import PackedLinear
from engine.runtime.loader import load_model
from engine.runtime.models.llama import LlamaSpec
from engine.runtime.models.rope import rope_inv_freq
from engine.runtime.step_inputs import prepare_inputs
from tests.oracle import random_prompt

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK_SIZE = 8
CPU = torch.device("cpu")

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
    ),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-head-dim": ("mistral", {"head_dim": 32, "sliding_window": None}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 16}),
}


class Paged:
    """Our model plus a KV pool; runs hand-built steps and returns logits for every row."""

    def __init__(self, model_dir, dtype=torch.float32, num_blocks=64):
        self.loaded = load_model(EngineConfig(model=str(model_dir)), CPU, dtype)
        spec = self.loaded.model.spec
        shape = (num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        self.kv = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(spec.num_layers)
        ]

    def run(self, make_step, seqs, num_decodes=0) -> torch.Tensor:
        inputs = prepare_inputs(make_step(seqs, BLOCK_SIZE, num_decodes), CPU)
        model = self.loaded.model
        with torch.inference_mode():
            hidden = model(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv, TorchRefBackend()
            )
            return model.compute_logits(hidden)


def hf_logits(model_dir, token_ids, dtype=torch.float32) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_full_sequence_logits_match_hf(variant, make_tiny_model, make_step):
    arch, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(arch, **overrides)
    ids = random_prompt(29)
    ours = Paged(model_dir).run(make_step, [ScheduledSeq(0, ids, 0, [5, 2, 9, 11])])
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


# fp32: oneDNN packs it on every x86-64 CPU; only a torch build without oneDNN lacks it.
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("variant", ["llama", "llama-tied", "llama-bias", "qwen2-bias"])
def test_packed_cpu_weights_still_match_hf(variant, make_tiny_model, make_step):
    arch, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(arch, **overrides)
    ids = random_prompt(21, seed=4)
    paged = Paged(model_dir)
    paged.loaded.model.pack_for_cpu()
    model = paged.loaded.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)  # the LM head too, tied or not
    ours = paged.run(make_step, [ScheduledSeq(0, ids, 0, [4, 1, 6])])
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen2-bias", "llama3-rope"])
def test_chunked_prefill_through_the_cache_matches_hf(variant, make_tiny_model, make_step):
    arch, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(arch, **overrides)
    ids = random_prompt(30, seed=1)
    paged, table = Paged(model_dir), [7, 3, 12, 1]
    first = paged.run(make_step, [ScheduledSeq(0, ids[:11], 0, table[:2])])
    rest = paged.run(make_step, [ScheduledSeq(0, ids[11:], 11, table)])
    expected = hf_logits(model_dir, ids)
    torch.testing.assert_close(torch.cat([first, rest]), expected, atol=1e-4, rtol=1e-4)


def test_batch_of_decodes_and_prefills_matches_hf(make_tiny_model, make_step):
    model_dir = make_tiny_model("llama")
    a, b, c = random_prompt(20, seed=2), random_prompt(9, seed=3), random_prompt(14, seed=4)
    paged = Paged(model_dir)
    # Step 1 caches a[:19] and b[:8]; step 2 decodes their last tokens beside c's prefill.
    paged.run(make_step, [ScheduledSeq(0, a[:19], 0, [0, 1, 2]), ScheduledSeq(1, b[:8], 0, [3])])
    seqs = [
        ScheduledSeq(0, a[19:], 19, [0, 1, 2]),
        ScheduledSeq(1, b[8:], 8, [3, 4]),
        ScheduledSeq(2, c, 0, [5, 6]),
    ]
    logits = paged.run(make_step, seqs, num_decodes=2)
    torch.testing.assert_close(logits[0], hf_logits(model_dir, a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(model_dir, b)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2:], hf_logits(model_dir, c), atol=1e-4, rtol=1e-4)


def test_bfloat16_forward_tracks_hf_bfloat16(make_tiny_model, make_step):
    model_dir = make_tiny_model("llama")
    ids = random_prompt(24, seed=5)
    ours = Paged(model_dir, dtype=torch.bfloat16).run(
        make_step, [ScheduledSeq(0, ids, 0, [0, 1, 2])]
    )
    expected = hf_logits(model_dir, ids, dtype=torch.bfloat16)
    assert ours.dtype == torch.float32  # compute_logits upcasts for the sampler
    torch.testing.assert_close(ours, expected, atol=0.1, rtol=0.05)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_rope_inv_freq_reads_legacy_rope_scaling_attributes():
    legacy = SimpleNamespace(  # a pre-transformers-5 style config
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=128,
    )
    expected = 1.0 / (500.0 ** (torch.arange(0, 8, 2).float() / 8)) / 2.0
    torch.testing.assert_close(rope_inv_freq(legacy, head_dim=8), expected)


def test_unsupported_rope_type_is_refused():
    yarn = SimpleNamespace(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
        max_position_embeddings=128,
    )
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        rope_inv_freq(yarn, head_dim=8)


def test_spec_reads_family_differences(make_tiny_model):
    from transformers import AutoConfig

    qwen2 = LlamaSpec.from_hf_config(AutoConfig.from_pretrained(make_tiny_model("qwen2")))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = LlamaSpec.from_hf_config(
        AutoConfig.from_pretrained(make_tiny_model("qwen3", head_dim=16))
    )
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 16)
    mistral = LlamaSpec.from_hf_config(
        AutoConfig.from_pretrained(make_tiny_model("mistral", head_dim=32, sliding_window=None))
    )
    assert (mistral.num_heads, mistral.num_kv_heads, mistral.head_dim) == (4, 2, 32)
