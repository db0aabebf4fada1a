"""Tiny random HF models built in code (no downloads): the oracles' weights for unit tests.

torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from typing import Any

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
        "gemma3": transformers.Gemma3TextConfig,
    }[arch]


# Gemma 3's shape in miniature: head_dim 64 (its default is 256; not hidden / heads, and a dim
# the native kernel takes), attention scaled by 24 ** -0.5 (not head_dim's), a window of 8
# positions (one block in the tests) on two of three layers, rope bases as the real model's.
TINY_GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 3,
    "head_dim": 64,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "tie_word_embeddings": True,
}


def build_tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any):
    """A random HF model of family `arch` ("llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"),
    eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    family = TINY_GEMMA3 if arch == "gemma3" else {}
    config = _config_class(arch)(**{**TINY_CONFIG, **family, **overrides})
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
