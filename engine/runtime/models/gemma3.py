"""Gemma 3 (text) over paged attention: the Llama family's pieces with Gemma's differences.

Each difference is computed as transformers' Gemma3ForCausalLM computes it:
- the embedded tokens are scaled by sqrt(hidden_size), in the weights' dtype;
- RMSNorm scales by (1 + w): 1 is added to each checkpoint norm weight once, at load, and the
  weight stays float32 (Gemma3RMSNorm), so the Llama norm (and its fused kernel) computes the
  same product;
- four norms per layer: the attention and MLP outputs are normed before their residual adds;
- q and k are normed per head before rope (as Qwen3's), and attention scales by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- the MLP gates with GELU (tanh approximation) instead of SiLU (on the CPU through the fused
  kernel: g sigmoid(2y), the same function within a few ulp of float64, where torch's
  g / 2 (1 + tanh(y)) loses its bits below g = -3);
- sliding-window layers (config.layer_types) attend to the last `sliding_window` positions
  and rotate with their own rope base; full-attention layers see every position.

Every layer keeps the KV of the whole context in the shared paged pool: a local layer simply
reads the last W positions of it (AttentionBackend.forward's window). The context is the
model's own (32,768 for Gemma 3), and a prefix-cache hit holds the KV a fresh prefill writes.

Axes: T tokens, E hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.attention.base import AttentionBackend, AttentionMetadata
from engine.runtime.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaSpec,
    RMSNorm,
    _linear,
)
from engine.runtime.models.rope import Rope, RotaryEmbedding, rope_inv_freq

_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma3Layout:
    """What Gemma 3 adds to LlamaSpec: each layer's window and the two rope settings."""

    windows: tuple[int | None, ...]  # per layer: the sliding window, or None (full attention)
    local: tuple[bool, ...]  # per layer: a sliding-attention layer (the local rope)
    attention_scale: float
    local_rope: Any  # an hf_config-like object rope_inv_freq reads (rope_parameters, ...)
    global_rope: Any
    final_logit_softcapping: float | None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Gemma3Layout:
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping (Gemma 2) is not supported")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal models only)")
        activation = getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} is not supported (GELU-tanh only)")
        num_layers = hf_config.num_hidden_layers
        layer_types = list(getattr(hf_config, "layer_types", None) or [])
        if not layer_types:  # older configs: every pattern-th layer is global
            pattern = getattr(hf_config, "sliding_window_pattern", 6)
            layer_types = [_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(num_layers)]
        window = getattr(hf_config, "sliding_window", None)
        local = tuple(kind == _SLIDING for kind in layer_types)
        windows = tuple(window if is_local else None for is_local in local)
        local_rope, global_rope = _rope_configs(hf_config)
        return cls(
            windows=windows,
            local=local,
            attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            local_rope=local_rope,
            global_rope=global_rope,
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
        )


def _rope_configs(hf_config: Any) -> tuple[Any, Any]:
    """(local, global) rope settings as single-rope configs rope_inv_freq reads: transformers 5
    nests them per layer type in rope_parameters; older configs name the local base apart."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    max_len = hf_config.max_position_embeddings
    if _SLIDING in params or _FULL in params:
        local, full = params.get(_SLIDING) or {}, params.get(_FULL) or {}
    else:
        full = dict(params or getattr(hf_config, "rope_scaling", None) or {})
        full.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 1_000_000.0)
        local = {"rope_type": "default"}
        local["rope_theta"] = getattr(hf_config, "rope_local_base_freq", None) or 10_000.0
    return (
        SimpleNamespace(rope_parameters=local, max_position_embeddings=max_len),
        SimpleNamespace(rope_parameters=full, max_position_embeddings=max_len),
    )


class Gemma3RMSNorm(RMSNorm):
    """RMSNorm rounded as transformers' Gemma norm: the (1 + w) weight held in float32 and the
    product taken in float32, cast once (Llama casts first, then scales in the model's dtype).
    In a float32 model both are the same bits, and the fused kernel serves it."""

    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(size, eps, device, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(
            x.dtype
        )

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == self.weight.dtype:
            return super().add_forward(x, delta)
        x = x + delta
        return x, self.forward(x)


class Gemma3MLP(LlamaMLP):
    """gate_up and down as Llama's, gated by GELU (tanh) rather than SiLU."""

    activation = "gelu_tanh"

    def _gate(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")

    def _fused_gate_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return self.fused.gelu_tanh_mul(gate_up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, window: int | None, scale: float, device, dtype) -> None:
        super().__init__()
        eps, size = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = Gemma3RMSNorm(size, eps, device, dtype)
        self.self_attn = LlamaAttention(spec, device, dtype)
        self.self_attn.scale = scale
        self.self_attn.window = window
        self.self_attn.q_norm = Gemma3RMSNorm(spec.head_dim, eps, device, dtype)
        self.self_attn.k_norm = Gemma3RMSNorm(spec.head_dim, eps, device, dtype)
        self.post_attention_layernorm = Gemma3RMSNorm(size, eps, device, dtype)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(size, eps, device, dtype)
        self.mlp = Gemma3MLP(spec, device, dtype)
        self.post_feedforward_layernorm = Gemma3RMSNorm(size, eps, device, dtype)

    def forward(
        self, rope: Rope, hidden, delta, kv_cache: KVCache, meta, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer's: the stream enters as hidden + delta and leaves as the returned
        pair; each residual add is fused into the norm after it."""
        if delta is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_forward(hidden, delta)
        attn_out = self.post_attention_layernorm(
            self.self_attn(rope, normed, kv_cache, meta, backend)
        )
        hidden, normed = self.pre_feedforward_layernorm.add_forward(hidden, attn_out)
        return hidden, self.post_feedforward_layernorm(self.mlp(normed, meta.tile_rows))


class Gemma3Model(nn.Module):
    def __init__(self, spec: LlamaSpec, layout: Gemma3Layout, device, dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(
            nn.Embedding, spec.vocab_size, spec.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(spec, window, layout.attention_scale, device, dtype)
            for window in layout.windows
        )
        self.norm = Gemma3RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text models (Gemma3ForCausalLM, gemma3_text) with LlamaForCausalLM's interface:
    the same parameter names, fused projections, quantization and CPU packing."""

    # Local layers attend within their window (the context is not capped at it).
    implements_sliding_window = True
    # Gemma's turn format (engine/chat_template.py, GEMMA_TURNS) ends each turn with this.
    turn_end_tokens = ("<end_of_turn>",)
    # llama.cpp stores Gemma's q and k rows in the HF order (no rope interleave to undo).
    gguf_qk_rows_interleaved = False

    def __init__(
        self,
        hf_config: Any,
        max_positions: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM's body would build Llama layers
        spec = dataclasses.replace(LlamaSpec.from_hf_config(hf_config), qk_norm=True)
        self.spec = spec
        self.layout = layout = Gemma3Layout.from_hf_config(hf_config)
        if len(layout.windows) != spec.num_layers:
            raise ValueError(
                f"layer_types lists {len(layout.windows)} layers, the model has {spec.num_layers}"
            )
        self.rotary = RotaryEmbedding(
            rope_inv_freq(layout.global_rope, spec.head_dim), max_positions, device, dtype
        )
        self.rotary_local = RotaryEmbedding(
            rope_inv_freq(layout.local_rope, spec.head_dim), max_positions, device, dtype
        )
        self.model = Gemma3Model(spec, layout, device, dtype)
        # transformers multiplies by a float32 scalar cast to the weights' dtype.
        embed_scale = torch.tensor(spec.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", embed_scale.to(device), persistent=False)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = _linear(spec.hidden_size, spec.vocab_size, False, device, dtype)
        self.native_decode = None  # set by use_native_decode()
        self.greedy_head = None

    @property
    def max_window(self) -> int | None:
        """The widest sliding window, or None when every layer sees the whole context."""
        windows = [w for w in self.layout.windows if w is not None]
        return max(windows) if windows else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden rows [T, E] (or [R, E] of output_rows), K/V written for all."""
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale  # [T, E], fresh
        if self.native_decode is not None:  # every layer in one native call
            out = self.native_decode.run(hidden, positions, meta, kv_caches, output_rows)
            if out is not None:
                return out
        ropes = (self.rotary.lookup(positions), self.rotary_local.lookup(positions))
        delta = None
        layers = zip(self.model.layers, kv_caches, self.layout.local, strict=True)
        for layer, kv_cache, is_local in layers:
            hidden, delta = layer(ropes[is_local], hidden, delta, kv_cache, meta, backend)
        out = self.model.norm.add_forward(hidden, delta)[1]
        return out if output_rows is None else out[output_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.layout.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loading, then (1 + w) folded into every norm weight once."""
        super().load_weights(weights)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
