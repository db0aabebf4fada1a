"""A step's layer stack in one native call (engine/runtime/cpu/decode_step.cpp).

On a step of a model whose projections are GGUF blocks (quantization native or q8_0),
LlamaForCausalLM.forward (and Gemma3ForCausalLM.forward) hands the embedded tokens to
NativeDecodeStep.run(), which runs every layer and the final norm in C++: the same kernels, in
the same order, on the same buffers as the module-by-module forward, so the result is
bit-identical to it (the tests compare both), without the interpreter's per-op cost between the
9 to 13 ops of each layer. Decode rows and prefill chunks alike: attention computes every token
as a decode query at its own position over its sequence's block table (what the CPU attention
backend does for prefill chunks too), so a token's row is per-token tables and lengths here,
whatever step it is in.

Checked once: the model's shape (fp32, no biases, block projections, a head size the paged
kernel covers, one attention scale, an activation the kernel has). Llama, Qwen3 (q/k norms) and
Gemma 3 (q/k norms, four norms a layer, GELU-tanh, per-layer windows and rope tables) qualify.
Checked once per step: contiguous fp32, fp16 or bf16 caches (kv_cache_dtype), block tables
inside the pool. Anything else returns None and the torch forward runs. Buffers are allocated
per batch-size bucket (powers of two) and reused: no allocation per step beyond the step's own
tables.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.cpu.block_linear import BlockLinear, BlockLinearParts
from engine.runtime.cpu.native import CACHE_DTYPE_CODES, cache_dtype_code

_LANES = 16  # the kernels' vector width in floats
_NO_ROWS = torch.zeros(1, dtype=torch.int64)  # keep's address when every row is wanted
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # decode_step.cpp's Dims::activation


@dataclass
class _Bucket:
    """Activation buffers for up to `rows` tokens, and their addresses as the kernel reads them."""

    rows: int
    tensors: list[torch.Tensor]  # normed, qkv, q, attn, delta, gate_up, act, part, out
    addresses: torch.Tensor  # int64 [8]: the first eight's data pointers


class NativeDecodeStep:
    """The layer stack of every step for one block-quantized Llama-family or Gemma 3 model."""

    def __init__(self, model: nn.Module, library: ctypes.CDLL) -> None:
        self._model = model
        self._run = library.kvshare_decode_layers
        spec = model.spec
        self._widths = (
            spec.hidden_size,
            (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
            spec.num_heads * spec.head_dim,
            spec.num_heads * spec.head_dim,
            spec.hidden_size,
            2 * spec.intermediate_size,
            spec.intermediate_size,
            (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,  # part (of q/k/v)
            spec.hidden_size,
        )
        layers = model.model.layers
        local = _local_rope(model)
        self._layer_ints = torch.tensor(
            [_layer_ints(layer, is_local) for layer, is_local in zip(layers, local, strict=True)],
            dtype=torch.int32,
        )
        self._activation = _ACTIVATIONS[layers[0].mlp.activation]
        self._scale = layers[0].self_attn.scale
        self._buckets: dict[int, _Bucket] = {}
        self._layer_table: torch.Tensor | None = None
        self._caches_key: tuple[int, ...] = ()
        self.steps_run = 0  # decode steps served here (tests and the profile read it)

    @classmethod
    def for_model(cls, model: nn.Module, library: ctypes.CDLL) -> NativeDecodeStep | None:
        """The native step for `model`, or None when the model is not one it computes exactly."""
        spec = getattr(model, "spec", None)
        if spec is None or not hasattr(library, "kvshare_decode_layers"):
            return None
        if spec.qkv_bias or spec.o_bias or spec.mlp_bias:
            return None
        group = spec.num_heads // spec.num_kv_heads
        if spec.num_heads % spec.num_kv_heads or not library.kvshare_supports_shape(
            spec.head_dim, group
        ):
            return None
        if (spec.head_dim // 2) % _LANES or spec.hidden_size % _LANES:
            return None
        if spec.intermediate_size % _LANES:
            return None
        ropes = (model.rotary, getattr(model, "rotary_local", model.rotary))
        if any(rope.cos.dtype != torch.float32 for rope in ropes):
            return None
        layers = model.model.layers
        if len(_local_rope(model)) != len(layers):
            return None
        for layer in layers:
            if any(_parts(layer, name) is None for name in _PROJECTIONS):
                return None
            if getattr(layer.mlp, "activation", None) not in _ACTIVATIONS:
                return None
            if layer.mlp.activation != layers[0].mlp.activation:
                return None
            if layer.self_attn.scale != layers[0].self_attn.scale:
                return None
            norms = _norms(layer)
            if norms[2] is not None and norms[3] is None:  # q/k norms come in pairs
                return None
            if any(
                w is not None and (w.dtype != torch.float32 or not w.is_contiguous()) for w in norms
            ):
                return None
        return cls(model, library)

    def run(
        self,
        hidden: torch.Tensor,  # [T, E] fp32, the embedded tokens: becomes the residual stream
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: torch.Tensor | None = None,  # [R] int64, increasing; None: all
    ) -> torch.Tensor | None:
        """The final-normed rows [T, E], or [R, E] of output_rows (a view of a reused buffer:
        read it before the next step), or None for a step this path does not take (nothing was
        touched then). With output_rows the last layer runs past its K/V store on those rows
        only: a prefill chunk's other rows need their K/V and nothing else."""
        num_tokens = hidden.shape[0]
        if not num_tokens or hidden.dtype != torch.float32 or not hidden.is_contiguous():
            return None
        layer_table = self._layers(kv_caches)
        if layer_table is None:
            return None
        k_cache = kv_caches[0][0]
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        tables, seq_lens = _token_tables(meta, num_tokens)
        if int(tables.max()) >= num_blocks or meta.max_seq_len > tables.shape[1] * block_size:
            return None
        tile_rows = meta.tile_rows
        if tile_rows is not None and (
            tile_rows.shape != (num_tokens,) or tile_rows.dtype != torch.int32
        ):
            return None
        keep, num_keep = _NO_ROWS, -1
        if output_rows is not None and len(output_rows) < num_tokens:
            # The kernel compacts the kept rows' tables in place: never the step's own.
            keep, num_keep = output_rows.to(torch.int64).contiguous(), len(output_rows)
            tables, seq_lens = tables.clone(), seq_lens.clone()
            tile_rows = None if tile_rows is None else tile_rows.clone()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        rotary = self._model.rotary
        cos, sin = rotary.cos[positions].contiguous(), rotary.sin[positions].contiguous()
        cos_local = sin_local = None
        if (local := getattr(self._model, "rotary_local", None)) is not None:
            cos_local = local.cos[positions].contiguous()
            sin_local = local.sin[positions].contiguous()
        bucket = self._bucket(num_tokens)
        out = bucket.tensors[-1]
        spec = self._model.spec
        dims = torch.tensor(
            [num_tokens, spec.hidden_size, spec.intermediate_size, spec.num_heads,
             spec.num_kv_heads, spec.head_dim, spec.num_layers, block_size, tables.shape[1],
             num_blocks * block_size, CACHE_DTYPE_CODES[k_cache.dtype], self._activation],
            dtype=torch.int64,
        )  # fmt: skip
        status = self._run(
            dims.data_ptr(), layer_table.data_ptr(), self._layer_ints.data_ptr(),
            bucket.addresses.data_ptr(), hidden.data_ptr(), out.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), None if cos_local is None else cos_local.data_ptr(),
            None if sin_local is None else sin_local.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), seq_lens.data_ptr(),
            None if tile_rows is None else tile_rows.data_ptr(), keep.data_ptr(), num_keep,
            self._model.model.norm.weight.data_ptr(), spec.rms_norm_eps, self._scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native decode step failed with status {status}")
        self.steps_run += 1
        return out[: num_tokens if num_keep < 0 else num_keep]

    def _layers(self, kv_caches) -> torch.Tensor | None:
        """The per-layer address table [L, 14], rebuilt only when the caches change."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._layer_table is not None and key == self._caches_key:
            return self._layer_table
        layers = self._model.model.layers
        if len(kv_caches) != len(layers) or not all(_cache_covered(k, v) for k, v in kv_caches):
            return None
        rows = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            input_norm, pre_mlp, *extra = _norms(layer)
            qkv, *more = (part.block_weight.data for part in _parts(layer, _PROJECTIONS[0]))
            others = (_parts(layer, name)[0].block_weight.data for name in _PROJECTIONS[1:])
            weights = [qkv, *others]
            more += [None] * (2 - len(more))
            tensors = (input_norm, pre_mlp, *weights, k_cache, v_cache)
            rows.append([*(t.data_ptr() for t in tensors), *map(_address, (*extra, *more))])
        self._layer_table, self._caches_key = torch.tensor(rows, dtype=torch.int64), key
        return self._layer_table

    def _bucket(self, num_tokens: int) -> _Bucket:
        rows = 1 << (num_tokens - 1).bit_length()  # the next power of two
        bucket = self._buckets.get(rows)
        if bucket is None:
            tensors = [torch.empty((rows, width), dtype=torch.float32) for width in self._widths]
            addresses = torch.tensor([t.data_ptr() for t in tensors[:-1]], dtype=torch.int64)
            bucket = self._buckets[rows] = _Bucket(rows, tensors, addresses)
        return bucket


def _token_tables(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token as a decode query: its sequence's block table [T, max_blocks] and the length
    it sees [T] (its position + 1), int32 and contiguous, as the paged kernel reads them."""
    num_seqs = meta.num_seqs
    if meta.num_decodes == num_seqs == num_tokens:  # one token a sequence: the step's own
        tables, seq_lens = meta.block_tables[:num_tokens], meta.seq_lens[:num_tokens]
    else:
        starts = meta.query_start_loc[: num_seqs + 1].long()
        owner = torch.repeat_interleave(torch.arange(num_seqs), starts[1:] - starts[:-1])  # [T]
        # token t of sequence s sits (ends[s] - 1 - t) places before the sequence's last
        seq_lens = meta.seq_lens[owner] - (starts[1:][owner] - 1 - torch.arange(num_tokens))
        tables = meta.block_tables[owner]
    return tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()


def _norms(layer: nn.Module) -> tuple[torch.Tensor | None, ...]:
    """The layer's norm weights as decode_step.cpp's Layer takes them: input, the one before the
    MLP, q, k, the attention output's, the MLP output's (None where the layer has none). A
    Gemma 3 layer names the norm before its MLP pre_feedforward_layernorm and the attention
    output's post_attention_layernorm; a Llama layer's post_attention_layernorm is the former."""
    attention = layer.self_attn
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
    attn_out = None
    if pre_mlp is None:
        pre_mlp = layer.post_attention_layernorm
    else:
        attn_out = layer.post_attention_layernorm
    mlp_out = getattr(layer, "post_feedforward_layernorm", None)
    modules = (layer.input_layernorm, pre_mlp, q_norm, k_norm, attn_out, mlp_out)
    return tuple(None if m is None else m.weight for m in modules)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _local_rope(model: nn.Module) -> tuple[bool, ...]:
    """Per layer, whether it rotates with the model's local rope (rotary_local; Gemma 3's
    sliding layers, layout.local) rather than its rotary."""
    layout = getattr(model, "layout", None)
    if layout is None or getattr(model, "rotary_local", None) is None:
        return (False,) * len(model.model.layers)
    return tuple(layout.local)


def _parts(layer: nn.Module, name: str) -> list[BlockLinear] | None:
    """The projection's block weights: one BlockLinear, or for q/k/v up to three runs of rows
    of one format each (BlockLinearParts); None where the step cannot compute it."""
    module = layer.get_submodule(name)
    parts = list(module.parts) if isinstance(module, BlockLinearParts) else [module]
    if len(parts) > (3 if name == _PROJECTIONS[0] else 1):
        return None
    if not all(isinstance(part, BlockLinear) and part.bias is None for part in parts):
        return None
    return parts


def _layer_ints(layer: nn.Module, is_local: bool) -> list[int]:
    """A layer's int32 row as decode_step.cpp reads it (kLayerInts)."""
    qkv = _parts(layer, _PROJECTIONS[0])
    codes = [qkv[0].block_weight.code]
    codes += [_parts(layer, name)[0].block_weight.code for name in _PROJECTIONS[1:]]
    more = [part.block_weight.code for part in qkv[1:]] + [0] * (3 - len(qkv))
    rows = [part.out_features for part in qkv][:2]
    if len(qkv) == 2:  # the second part ends the rows
        rows[1] = sum(part.out_features for part in qkv) - rows[0]
    rows += [0] * (2 - len(rows))
    return [*codes, layer.self_attn.window or 0, int(is_local), *more, *rows]


def _cache_covered(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """A KV cache the kernels read under fp32 activations (fp32, fp16 or bf16)."""
    return (
        k_cache.dtype == v_cache.dtype
        and cache_dtype_code(torch.float32, k_cache.dtype) is not None
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.device.type == "cpu"
    )
