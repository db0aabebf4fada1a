"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over paged attention.

One flattened batch per call: input_ids [T], positions [T] and the step's AttentionMetadata.
Each layer writes its new K/V through meta.slot_mapping and reads its context through the
block tables. q/k/v and gate/up are fused into one matmul each (one weight read per layer).

Axes: T tokens, H query heads, Hkv KV heads, D head dim, E hidden size, I intermediate, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.attention.base import AttentionBackend, AttentionMetadata
from engine.runtime.cpu.block_linear import BlockLinear, BlockLinearParts
from engine.runtime.cpu.decode_step import NativeDecodeStep
from engine.runtime.cpu.fused import CpuFusedOps
from engine.runtime.cpu.linear import PackedLinear, pack_linears
from engine.runtime.models.rope import Rope, RotaryEmbedding, apply_rope, rope_inv_freq

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LlamaSpec:
    """The shape of one model, resolved from an HF config of any supported family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before rope
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> LlamaSpec:
        model_type = getattr(hf_config, "model_type", "llama")
        num_heads = hf_config.num_attention_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            # Qwen2 always has q/k/v biases (and none on o_proj); Llama/Qwen3 follow attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.eps = eps
        self.fused: CpuFusedOps | None = None  # set by use_fused_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None if self.fused is None else self.fused.rms_norm(x, self.weight, self.eps)
        if out is not None:
            return out
        # Statistics in fp32, scale in the input dtype: the same rounding as transformers.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, forward(x + delta)): the residual add before a norm. The fused path
        writes the sum into x (one pass, no temporary); callers own x."""
        out = (
            None if self.fused is None else self.fused.add_rms_norm(x, delta, self.weight, self.eps)
        )
        if out is not None:
            return x, out
        x = x + delta
        return x, self.forward(x)


def _linear(in_features: int, out_features: int, bias: bool, device, dtype) -> nn.Linear:
    # No random init: every weight is overwritten by the checkpoint.
    return nn.utils.skip_init(
        nn.Linear, in_features, out_features, bias=bias, device=device, dtype=dtype
    )


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, device, dtype) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.window: int | None = None  # a sliding-window layer's width (Gemma 3); None: all
        self.qkv_proj = _linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, device, dtype
        )
        self.o_proj = _linear(self.q_size, spec.hidden_size, spec.o_bias, device, dtype)
        self.fused: CpuFusedOps | None = None  # set by use_fused_ops()
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = _project(self.qkv_proj, x, meta.tile_rows)  # [T, (H + 2Hkv) * D]
        k_cache, v_cache = kv_cache
        normed = self.q_norm is None  # q and k as rope takes them
        if self.fused is not None and not normed:  # q/k norms in place on qkv, one native pass
            normed = self.fused.qk_norm(
                qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight,
                self.q_norm.eps,
            )  # fmt: skip
        if self.fused is not None and normed:
            # Rope on q and k and the KV store in one native pass (four calls otherwise).
            q = self.fused.rope_store(
                qkv, self.num_heads, *rope, k_cache, v_cache, meta.slot_mapping
            )
            if q is not None:
                out = backend.forward(q, k_cache, v_cache, meta, self.scale, self.window)
                return _project(self.o_proj, out.reshape(num_tokens, self.q_size), meta.tile_rows)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not normed:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, rope), self._rope(k, rope)
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale, self.window)  # [T, H, D]
        return _project(self.o_proj, out.reshape(num_tokens, self.q_size), meta.tile_rows)

    def _rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if self.fused is not None and (out := self.fused.rope(x, *rope)) is not None:
            return out
        return apply_rope(x, rope)


def _project(linear: nn.Module, x: torch.Tensor, tile_rows: torch.Tensor | None) -> torch.Tensor:
    """linear(x); a block projection takes each row's kernel path from the step (tile_rows,
    AttentionMetadata), any other the one it has."""
    if tile_rows is not None and isinstance(linear, BlockLinear | BlockLinearParts):
        return linear(x, tile_rows)
    return linear(x)


class LlamaMLP(nn.Module):
    activation = "silu"  # the gate's (NativeDecodeStep reads it)

    def __init__(self, spec: LlamaSpec, device, dtype) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = _linear(spec.hidden_size, 2 * size, spec.mlp_bias, device, dtype)
        self.down_proj = _linear(size, spec.hidden_size, spec.mlp_bias, device, dtype)
        self.fused: CpuFusedOps | None = None  # set by use_fused_ops()

    def forward(self, x: torch.Tensor, tile_rows: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = _project(self.gate_up_proj, x, tile_rows)  # [T, 2I]
        if self.fused is not None and (act := self._fused_gate_mul(gate_up)) is not None:
            return _project(self.down_proj, act, tile_rows)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        # in place: one [T, I] temporary less
        return _project(self.down_proj, self._gate(gate).mul_(up), tile_rows)

    def _gate(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def _fused_gate_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return self.fused.silu_mul(gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, device, dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(spec, device, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(spec, device, dtype)

    def forward(
        self, rope: Rope, hidden, delta, kv_cache, meta, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream enters as hidden + delta (delta None before the first layer)
        and leaves as the returned (hidden, delta): each add is fused into the norm after it."""
        if delta is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_forward(hidden, delta)
        attn_out = self.self_attn(rope, normed, kv_cache, meta, backend)
        hidden, normed = self.post_attention_layernorm.add_forward(hidden, attn_out)
        return hidden, self.mlp(normed, meta.tile_rows)


class LlamaModel(nn.Module):
    def __init__(self, spec: LlamaSpec, device, dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(
            nn.Embedding, spec.vocab_size, spec.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, device, dtype) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)


# Checkpoint projections that live in a fused parameter: (fused name, shard index).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; parameters mirror the HF names.

    forward() returns final-normed hidden states [T, E] for every token; compute_logits()
    takes only the rows that need sampling, so the [*, V] matmul runs for those rows alone.
    """

    def __init__(
        self,
        hf_config: Any,
        max_positions: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.spec = spec = LlamaSpec.from_hf_config(hf_config)
        inv_freq = rope_inv_freq(hf_config, spec.head_dim)
        self.rotary = RotaryEmbedding(inv_freq, max_positions, device, dtype)
        self.model = LlamaModel(spec, device, dtype)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = _linear(spec.hidden_size, spec.vocab_size, False, device, dtype)
        self.native_decode: NativeDecodeStep | None = None  # set by use_native_decode()
        # Greedy tokens without all the logits (a Q8_0 block head, quant.py); None: compute them.
        self.greedy_head: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],  # per layer, [num_blocks, block_size, Hkv, D] each
        backend: AttentionBackend,
        output_rows: torch.Tensor | None = None,  # [R] increasing row indices; None: all
    ) -> torch.Tensor:
        """Run every layer over the flattened batch, writing K/V into the caches: the final
        hidden rows [T, E], or [R, E] of output_rows (the native step then skips the last
        layer's work past the K/V store for the other rows; the rows are the same either way)."""
        hidden = self.model.embed_tokens(input_ids)  # [T, E], a fresh tensor the adds may reuse
        if self.native_decode is not None:  # every layer in one native call
            out = self.native_decode.run(hidden, positions, meta, kv_caches, output_rows)
            if out is not None:
                return out
        rope = self.rotary.lookup(positions)
        delta = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, delta = layer(rope, hidden, delta, kv_cache, meta, backend)
        out = self.model.norm.add_forward(hidden, delta)[1]
        return out if output_rows is None else out[output_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] in fp32 (select the rows first)."""
        fused = self.model.norm.fused
        weight = self._plain_head_weight() if fused is not None else None
        if weight is not None and (logits := fused.gemv(hidden, weight)) is not None:
            return logits.float()  # a decode of 1-2 rows: the head streamed once, near bandwidth
        if self.lm_head is None:  # tied and not packed
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] -> [N] int64: compute_logits(hidden).argmax(-1), from fewer than all
        the logits where the head allows it; None where it does not (compute them)."""
        return None if self.greedy_head is None else self.greedy_head(hidden)

    def _plain_head_weight(self) -> torch.Tensor | None:
        """The exact LM head's [V, E] weight in its plain layout, where one exists without a
        copy (tied, or not packed); None for a packed untied or quantized head."""
        if self.lm_head is None or (
            self.spec.tie_word_embeddings and isinstance(self.lm_head, PackedLinear)
        ):
            return self.model.embed_tokens.weight
        return self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else None

    def use_fused_ops(self, ops: CpuFusedOps | None) -> None:
        """Run RMSNorm (and the residual add before it), SiLU-and-mul, rope with the KV store,
        and a small batch's LM head through `ops` where they cover the call (None: torch
        everywhere): CpuFusedOps with the CPU backend, TritonFusedOps (attention/
        triton_fused.py) with Triton's. The KV store then writes the caches directly, in the
        layout every backend shares (attention/base.py)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaMLP | LlamaAttention):
                module.fused = ops

    def use_native_decode(self, step: NativeDecodeStep | None) -> None:
        """Run steps through `step` (engine/runtime/cpu/decode_step.py: the same
        kernels as the fused modules, with no Python between them); None: module by module."""
        self.native_decode = step

    def pack_for_cpu(self) -> None:
        """Run every projection and the LM head on oneDNN with packed weights (see
        runtime/cpu/linear.py); call after load_weights, when can_pack() says so."""
        pack_linears(self.model)
        if self.lm_head is None and isinstance(self.model.embed_tokens, nn.Embedding):
            # A tied head becomes a packed copy of the embedding (the lookup keeps the plain table).
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)
        elif isinstance(self.lm_head, nn.Linear):
            self.lm_head = PackedLinear(self.lm_head.weight, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; raise if any part stays unset.

        Tensors are cast to the parameter dtype and moved to its device one at a time.
        """
        params = dict(self.named_parameters())
        expected = {(name, s) for name in params for s in range(self._num_shards(name))}
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
            destination = self._shard_view(params[name].data, name, shard)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add((name, shard))
        missing = sorted({name for name, _ in expected - loaded})
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")

    def _target(self, hf_name: str) -> tuple[str, int] | None:
        tied = self.spec.tie_word_embeddings
        if "rotary_emb." in hf_name or (tied and hf_name.startswith("lm_head.")):
            return None  # recomputed buffers; tied heads reuse the embedding
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return hf_name, 0

    def _num_shards(self, name: str) -> int:
        if ".qkv_proj." in name:
            return 3
        return 2 if ".gate_up_proj." in name else 1

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        spec = self.spec
        if ".qkv_proj." in name:
            q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            offsets = (0, q_size, q_size + kv_size)
            sizes = (q_size, kv_size, kv_size)
            return data.narrow(0, offsets[shard], sizes[shard])
        if ".gate_up_proj." in name:
            size = spec.intermediate_size
            return data.narrow(0, shard * size, size)
        return data
