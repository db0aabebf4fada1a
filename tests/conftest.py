"""Shared fixtures: tiny random HF checkpoints saved to disk, and a paged-batch builder.

torch and transformers are imported inside the fixtures so that test modules which never
touch a model (app/, engine core) do not pay for them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TINY_VOCAB = 256
TINY_MAX_LEN = 256

# Small enough to run in milliseconds; GQA (4 query heads over 2 KV heads); peaky logits
# (initializer_range) so greedy argmax has no near-ties to flip on.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": TINY_MAX_LEN,
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _config_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]


def build_tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any):
    """A random HF model of family `arch` ("llama" | "mistral" | "qwen2" | "qwen3"), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config_class(arch)(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # HF initialises biases to 0 and norm weights to 1; random ones make them matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """make_tiny_model(arch="llama", seed=0, **config_overrides) -> saved HF directory.

    Session-cached by arguments; the same arguments always give the same weights.
    """
    saved: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in saved:
            model = build_tiny_hf_model(arch, seed, **overrides)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            saved[key] = path
        return saved[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> Path:
    """The default tiny Llama (untied embeddings, GQA 4/2, vocab 256, 256 positions)."""
    return make_tiny_model()


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV slots of positions start..end-1 for a sequence with this block table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


@pytest.fixture
def make_step() -> Callable[..., Any]:
    """make_step(seqs, block_size, num_decodes=0) -> SchedulerOutput with its slot_mapping."""
    from engine.core.batch import SchedulerOutput

    def make(seqs, block_size: int, num_decodes: int = 0, block_copies=None):
        slot_mapping = [
            slot
            for seq in seqs
            for slot in slots_for(seq.block_ids, seq.start_pos, seq.context_len, block_size)
        ]
        return SchedulerOutput(
            seqs=list(seqs),
            slot_mapping=slot_mapping,
            block_copies=list(block_copies or []),
            num_decodes=num_decodes,
        )

    return make


@pytest.fixture
def single_thread():
    """Run a test on one torch thread (restored after): tiny shapes gain nothing from more,
    and on a busy machine OpenMP threads spinning against each other cost seconds per test."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
