"""Rotary position embedding as HF Llama checkpoints use it (rotate-half), with the rope types
transformers applies to the Llama family: default, linear, dynamic, llama3.

Axes: T tokens, P positions, D head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D/2]


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Rope settings from `rope_parameters` (transformers 5) or `rope_scaling`/`rope_theta`."""
    params = dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def rope_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32), computed as transformers does for the same config.

    `dynamic` equals `default` within max_position_embeddings, which positions never pass.
    """
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params, hf_config.max_position_embeddings)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any], max_pos: int) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context_len / high) & (wavelen <= old_context_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position below max_positions, precomputed in fp32 then cast."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device, dtype) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """cos and sin [T, 1, D/2] of each token's position; once per step, for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate-half rope on x [T, heads, D] (the convention of HF Llama checkpoints)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
