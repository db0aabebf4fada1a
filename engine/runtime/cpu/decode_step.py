"""A step's layer stack in one native call (engine/runtime/cpu/decode_step.cpp).

On a step of a model whose projections are GGUF blocks (quantization native or q8_0),
LlamaForCausalLM.forward hands the embedded tokens to NativeDecodeStep.run(), which runs every
layer and the final norm in C++: the same kernels, in the same order, on the same buffers as the
module-by-module forward, so the result is bit-identical to it (the tests compare both), without
the interpreter's per-op cost between the 9 ops of each layer. Decode rows and prefill chunks
alike: attention computes every token as a decode query at its own position over its
sequence's block table (what the CPU attention backend does for prefill chunks too), so a
token's row is per-token tables and lengths here, whatever step it is in.

Checked once: the model's shape (fp32, no biases, no q/k norms, block projections, a head
size the paged kernel covers). Checked once per step: contiguous fp32, fp16 or bf16 caches
(kv_cache_dtype), block tables inside the pool. Anything else returns None and the torch
forward runs. Buffers are allocated per batch-size bucket (powers of two) and reused: no
allocation per step beyond the step's own tables.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.cpu.block_linear import BlockLinear
from engine.runtime.cpu.native import CACHE_DTYPE_CODES, cache_dtype_code

_LANES = 16  # the kernels' vector width in floats
_NO_ROWS = torch.zeros(1, dtype=torch.int64)  # keep's address when every row is wanted
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class _Bucket:
    """Activation buffers for up to `rows` tokens, and their addresses as the kernel reads them."""

    rows: int
    tensors: list[torch.Tensor]  # normed, qkv, q, attn, delta, gate_up, act, out
    addresses: torch.Tensor  # int64 [7]: the first seven's data pointers


class NativeDecodeStep:
    """The layer stack of every step for one block-quantized Llama model."""

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
            spec.hidden_size,
        )
        layers = model.model.layers
        self._formats = torch.tensor(
            [[_block(layer, name).block_weight.code for name in _PROJECTIONS] for layer in layers],
            dtype=torch.int32,
        )
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
        if spec.qkv_bias or spec.o_bias or spec.mlp_bias or spec.qk_norm:
            return None
        group = spec.num_heads // spec.num_kv_heads
        if spec.num_heads % spec.num_kv_heads or not library.kvshare_supports_shape(
            spec.head_dim, group
        ):
            return None
        if (spec.head_dim // 2) % _LANES or spec.hidden_size % _LANES:
            return None
        if spec.intermediate_size % _LANES or model.rotary.cos.dtype != torch.float32:
            return None
        for layer in model.model.layers:
            if any(_block(layer, name) is None for name in _PROJECTIONS):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
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
        bucket = self._bucket(num_tokens)
        out = bucket.tensors[-1]
        spec = self._model.spec
        dims = torch.tensor(
            [num_tokens, spec.hidden_size, spec.intermediate_size, spec.num_heads,
             spec.num_kv_heads, spec.head_dim, spec.num_layers, block_size, tables.shape[1],
             num_blocks * block_size, CACHE_DTYPE_CODES[k_cache.dtype]],
            dtype=torch.int64,
        )  # fmt: skip
        status = self._run(
            dims.data_ptr(), layer_table.data_ptr(), self._formats.data_ptr(),
            bucket.addresses.data_ptr(), hidden.data_ptr(), out.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
            None if tile_rows is None else tile_rows.data_ptr(), keep.data_ptr(), num_keep,
            self._model.model.norm.weight.data_ptr(), spec.rms_norm_eps, spec.head_dim**-0.5,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"native decode step failed with status {status}")
        self.steps_run += 1
        return out[: num_tokens if num_keep < 0 else num_keep]

    def _layers(self, kv_caches) -> torch.Tensor | None:
        """The per-layer address table [L, 8], rebuilt only when the caches change."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._layer_table is not None and key == self._caches_key:
            return self._layer_table
        layers = self._model.model.layers
        if len(kv_caches) != len(layers) or not all(_cache_covered(k, v) for k, v in kv_caches):
            return None
        rows = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            weights = [_block(layer, name).block_weight.data for name in _PROJECTIONS]
            rows.append([t.data_ptr() for t in (*norms, *weights, k_cache, v_cache)])
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


def _block(layer: nn.Module, name: str) -> BlockLinear | None:
    module = layer.get_submodule(name)
    return module if isinstance(module, BlockLinear) and module.bias is None else None


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
