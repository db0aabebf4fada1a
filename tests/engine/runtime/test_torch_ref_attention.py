"""TorchRefBackend against dense causal attention computed per sequence from plain K/V."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.attention.torch_ref import TorchRefBackend

pytestmark = pytest.mark.usefixtures("single_thread")

HEAD_DIM = 16
NUM_POOL_BLOCKS = 48


def dense_attention(q, k, v, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start..start+n-1 over k/v [S, Hkv, D]: [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, S]
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


class Case:
    """Sequences (context_len, num_new_tokens), decodes first, scattered over a shuffled pool."""

    def __init__(self, seqs, num_heads, num_kv_heads, block_size, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size = seqs, block_size
        self.k_cache = torch.zeros(NUM_POOL_BLOCKS, block_size, num_kv_heads, HEAD_DIM, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        free = torch.randperm(NUM_POOL_BLOCKS, generator=gen).tolist()
        self.tables, self.keys, self.values, self.queries = [], [], [], []
        for context_len, num_new in seqs:
            num_blocks = math.ceil(context_len / block_size)
            self.tables.append([free.pop() for _ in range(num_blocks)])
            shape = (context_len, num_kv_heads, HEAD_DIM)
            self.keys.append(torch.randn(shape, generator=gen).to(dtype))
            self.values.append(torch.randn(shape, generator=gen).to(dtype))
            self.queries.append(torch.randn(num_new, num_heads, HEAD_DIM, generator=gen).to(dtype))

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        table, size = self.tables[i], self.block_size
        return torch.tensor([table[p // size] * size + p % size for p in range(start, end)])

    def store_all(self, backend: TorchRefBackend) -> None:
        """Every token's K/V, cached context and new tokens alike, through store_kv."""
        for i, (context_len, _) in enumerate(self.seqs):
            slots = self.slots(i, 0, context_len)
            backend.store_kv(self.keys[i], self.values[i], self.k_cache, self.v_cache, slots)

    def metadata(self, num_decodes: int) -> AttentionMetadata:
        starts = [0]
        for _, num_new in self.seqs:
            starts.append(starts[-1] + num_new)
        seq_lens = [context_len for context_len, _ in self.seqs]
        width = max(len(t) for t in self.tables)
        tables = [t + [0] * (width - len(t)) for t in self.tables]
        return AttentionMetadata(
            slot_mapping=torch.cat([self.slots(i, c - n, c) for i, (c, n) in enumerate(self.seqs)]),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            max_query_len=max(n for _, n in self.seqs),
            query_start_loc_host=starts,
            seq_lens_host=seq_lens,
        )

    def expected(self, scale: float) -> torch.Tensor:
        parts = [
            dense_attention(q.float(), k.float(), v.float(), c - n, scale)
            for q, k, v, (c, n) in zip(self.queries, self.keys, self.values, self.seqs, strict=True)
        ]
        return torch.cat(parts)


def run_case(case: Case, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TorchRefBackend()
    case.store_all(backend)
    scale = HEAD_DIM**-0.5
    out = backend.forward(
        torch.cat(case.queries), case.k_cache, case.v_cache, case.metadata(num_decodes), scale
    )
    return out, case.expected(scale)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_decodes_match_dense_attention(block_size, num_heads, num_kv_heads):
    # Context lengths end mid-block, exactly on a block edge, and at 1 token.
    seqs = [(13, 1), (1, 1), (2 * block_size, 1), (3 * block_size + 5, 1)]
    out, expected = run_case(Case(seqs, num_heads, num_kv_heads, block_size), num_decodes=4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_prefills_match_dense_attention(block_size, num_heads, num_kv_heads):
    # A fresh prompt, a chunk after a cached prefix, and a chunk of one token after a prefix.
    seqs = [(21, 21), (37, 12), (block_size + 3, 1)]
    out, expected = run_case(Case(seqs, num_heads, num_kv_heads, block_size), num_decodes=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_mixed_decode_and_prefill_batch():
    seqs = [(9, 1), (40, 1), (17, 17), (30, 8)]
    out, expected = run_case(Case(seqs, 4, 2, block_size=8, seed=3), num_decodes=2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32_reference():
    seqs = [(11, 1), (26, 26), (19, 5)]
    out, expected = run_case(Case(seqs, 4, 2, block_size=8, dtype=torch.bfloat16), num_decodes=1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_store_kv_writes_exactly_the_mapped_slots():
    backend = TorchRefBackend()
    k_cache = torch.zeros(4, 8, 2, HEAD_DIM)
    v_cache = torch.zeros(4, 8, 2, HEAD_DIM)
    key = torch.randn(3, 2, HEAD_DIM)
    value = torch.randn(3, 2, HEAD_DIM)
    backend.store_kv(key, value, k_cache, v_cache, torch.tensor([17, 5, 31]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 5], key[1]) and torch.equal(v_cache[0, 5], value[1])
    assert torch.equal(k_cache[3, 7], key[2]) and torch.equal(v_cache[3, 7], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_copy_blocks_copies_every_layer_and_nothing_else():
    backend = TorchRefBackend()
    kv_caches = [(torch.randn(5, 8, 2, HEAD_DIM), torch.randn(5, 8, 2, HEAD_DIM)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in kv_caches]
    backend.copy_blocks(kv_caches, torch.tensor([1, 3]), torch.tensor([4, 0]))
    for (k, v), (k0, v0) in zip(kv_caches, before, strict=True):
        for cache, original in ((k, k0), (v, v0)):
            assert torch.equal(cache[4], original[1]) and torch.equal(cache[0], original[3])
            assert torch.equal(cache[1:4], original[1:4])
