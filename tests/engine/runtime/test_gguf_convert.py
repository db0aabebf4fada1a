"""GGUF conversion: the fast path writes what transformers writes, file for file and bit for bit,
on tiny llama and gemma3 GGUFs in several quantisation formats; other files go to transformers."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open

from engine.core.errors import ModelLoadError
from engine.runtime import gguf_convert
from engine.runtime.cpu import gguf_blocks
from engine.runtime.cpu.gguf_blocks import read_blocks
from engine.runtime.gguf_convert import read_header, write_hf_directory, write_with_transformers

Q = GGMLQuantizationType
HIDDEN = 256  # a K-quant block is 256 values, so every matrix row holds whole blocks
INTERMEDIATE = 256
NUM_LAYERS = 2

# gguf-py cannot quantise to the K formats: random blocks with finite f16 scales stand in.
_K_QUANT_F16_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # d (and dmin) within each block


def encode(array: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`array` (float32) as a GGUF stores it in `qtype`: values, or blocks along the last axis."""
    if qtype == Q.F32:
        return array
    if qtype not in _K_QUANT_F16_OFFSETS:
        return quantize(array, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = array.size // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in _K_QUANT_F16_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, size=(num_blocks, 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(*array.shape[:-1], -1)


def write_gguf(path: Path, arch: str, metadata, tokenizer, tensors, seed: int = 0) -> Path:
    """tensors: {name: (shape, qtype)}, filled with random values."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    for key, value in {**metadata, **tokenizer}.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (shape, qtype) in tensors.items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        writer.add_tensor(name, encode(values, qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_tensors(num_heads: int, num_kv_heads: int, vocab: int) -> dict:
    head_dim = HIDDEN // num_heads
    tensors = {
        "token_embd.weight": ((vocab, HIDDEN), Q.Q8_0),
        "output_norm.weight": ((HIDDEN,), Q.F32),
        "output.weight": ((vocab, HIDDEN), Q.Q6_K),  # untied, unlike gemma3's below
    }
    formats = [  # per layer, so every format meets the q/k permutation
        {"attn_q": Q.Q4_K, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q6_K},
        {"attn_q": Q.Q8_0, "attn_k": Q.Q4_K, "attn_v": Q.BF16, "attn_output": Q.F16},
    ]
    kv_rows = num_kv_heads * head_dim
    rows = {"attn_q": HIDDEN, "attn_k": kv_rows, "attn_v": kv_rows, "attn_output": HIDDEN}
    for layer in range(NUM_LAYERS):
        for name, qtype in formats[layer].items():
            tensors[f"blk.{layer}.{name}.weight"] = ((rows[name], HIDDEN), qtype)
        tensors |= {
            f"blk.{layer}.attn_norm.weight": ((HIDDEN,), Q.F32),
            f"blk.{layer}.ffn_norm.weight": ((HIDDEN,), Q.F32),
            f"blk.{layer}.ffn_gate.weight": ((INTERMEDIATE, HIDDEN), Q.Q4_0),
            f"blk.{layer}.ffn_up.weight": ((INTERMEDIATE, HIDDEN), Q.Q5_0),
            f"blk.{layer}.ffn_down.weight": ((HIDDEN, INTERMEDIATE), Q.Q4_K),
        }
    return tensors


def byte_level_vocab() -> dict:
    """A gpt2 (byte-level BPE) vocabulary: three control tokens, the 256 bytes, four merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "he ll", "hell o"]
    tokens = specials + list(bytes_to_unicode().values()) + ["he", "ll", "hell", "hello"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def sentencepiece_vocab() -> dict:
    """A Gemma-style (llama tokenizer, scores, no merges) vocabulary, with a blank token."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\n", "  ", "\u2581", *"abcdehlo", "\u2581h", "he", "ll", "hell", "hello"]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    tokens = specials + pieces + byte_tokens
    types = [3] * len(specials) + [4, 4] + [1] * (len(pieces) - 2) + [6] * len(byte_tokens)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * len(specials) + [0.0] * (len(tokens) - len(specials)),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }


def gemma3_tensors(num_heads: int, head_dim: int, vocab: int) -> dict:
    tensors = {
        "token_embd.weight": ((vocab, HIDDEN), Q.Q8_0),  # tied: no output.weight
        "output_norm.weight": ((HIDDEN,), Q.F32),
    }
    for layer in range(NUM_LAYERS):
        prefix = f"blk.{layer}"
        tensors |= {
            f"{prefix}.attn_norm.weight": ((HIDDEN,), Q.F32),
            f"{prefix}.attn_q.weight": ((num_heads * head_dim, HIDDEN), Q.Q5_0),
            f"{prefix}.attn_k.weight": ((head_dim, HIDDEN), Q.Q4_K if layer else Q.Q8_0),
            f"{prefix}.attn_v.weight": ((head_dim, HIDDEN), Q.Q6_K),
            f"{prefix}.attn_q_norm.weight": ((head_dim,), Q.F32),
            f"{prefix}.attn_k_norm.weight": ((head_dim,), Q.F32),
            f"{prefix}.attn_output.weight": ((HIDDEN, num_heads * head_dim), Q.Q4_K),
            f"{prefix}.post_attention_norm.weight": ((HIDDEN,), Q.F32),
            f"{prefix}.ffn_norm.weight": ((HIDDEN,), Q.F32),
            f"{prefix}.ffn_gate.weight": ((INTERMEDIATE, HIDDEN), Q.Q5_0),
            f"{prefix}.ffn_up.weight": ((INTERMEDIATE, HIDDEN), Q.Q8_0 if layer else Q.F16),
            f"{prefix}.ffn_down.weight": ((HIDDEN, INTERMEDIATE), Q.Q6_K),
            f"{prefix}.post_ffw_norm.weight": ((HIDDEN,), Q.F32),
        }
    return tensors


def tiny_llama_gguf(folder: Path) -> Path:
    tokenizer = byte_level_vocab()
    metadata = {
        "llama.context_length": 512,
        "llama.embedding_length": HIDDEN,
        "llama.block_count": NUM_LAYERS,
        "llama.feed_forward_length": INTERMEDIATE,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 100000.0,
        "llama.rope.dimension_count": HIDDEN // 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    tensors = llama_tensors(4, 2, len(tokenizer["tokenizer.ggml.tokens"]))
    return write_gguf(folder / "tiny-llama.gguf", "llama", metadata, tokenizer, tensors)


def tiny_gemma3_gguf(folder: Path, drop: str | None = None) -> Path:
    tokenizer = sentencepiece_vocab()
    metadata = {
        "gemma3.context_length": 1024,
        "gemma3.embedding_length": HIDDEN,
        "gemma3.block_count": NUM_LAYERS,
        "gemma3.feed_forward_length": INTERMEDIATE,
        "gemma3.attention.head_count": 2,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.key_length": 128,
        "gemma3.attention.value_length": 128,
        "gemma3.rope.freq_base": 1000000.0,
        "gemma3.attention.sliding_window": 64,
    }
    tensors = gemma3_tensors(2, 128, len(tokenizer["tokenizer.ggml.tokens"]))
    tensors.pop(drop, None)
    return write_gguf(folder / "tiny-gemma3.gguf", "gemma3", metadata, tokenizer, tensors)


def no_gguf_reader(*args, **kwargs):
    raise AssertionError("the fast path parsed the file with GGUFReader")


@pytest.mark.parametrize("make_gguf", [tiny_llama_gguf, tiny_gemma3_gguf])
def test_fast_path_writes_what_transformers_writes(make_gguf, tmp_path, monkeypatch):
    gguf_path = make_gguf(tmp_path)
    write_with_transformers(gguf_path, tmp_path / "transformers")
    with monkeypatch.context() as patched:  # the fast path, not a fallback, wrote this one
        patched.setattr(gguf, "GGUFReader", no_gguf_reader)
        patched.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_gguf_reader)
        patched.setattr("transformers.AutoTokenizer.from_pretrained", no_gguf_reader)
        write_hf_directory(gguf_path, tmp_path / "fast")

    expected, actual = tmp_path / "transformers", tmp_path / "fast"
    names = sorted(path.name for path in expected.iterdir())
    assert sorted(path.name for path in actual.iterdir()) == names
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(names)
    for name in names:
        if name.endswith(".safetensors"):
            assert_same_tensors(expected / name, actual / name)
        else:
            assert (actual / name).read_bytes() == (expected / name).read_bytes(), name


def assert_same_tensors(expected: Path, actual: Path) -> None:
    with safe_open(expected, "pt") as want, safe_open(actual, "pt") as got:
        assert got.metadata() == want.metadata()
        assert list(got.keys()) == list(want.keys())
        for key in want.keys():  # noqa: SIM118 (safe_open is no dict)
            want_tensor, got_tensor = want.get_tensor(key), got.get_tensor(key)
            assert got_tensor.dtype == want_tensor.dtype == torch.float32, key
            assert torch.equal(got_tensor, want_tensor), key


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.calls.append(gguf_path)


def not_a_gguf(path: Path) -> None:
    path.write_bytes(b"GGUF")


def tiny_qwen2_gguf(path: Path) -> None:
    write_gguf(path, "qwen2", {}, {}, {"a.weight": ((32,), Q.F32)})


@pytest.mark.parametrize("make_file", [not_a_gguf, tiny_qwen2_gguf])
def test_files_the_fast_path_does_not_cover_go_to_transformers(make_file, tmp_path, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(gguf_convert, "write_with_transformers", recorder)
    path = tmp_path / "model.gguf"
    make_file(path)
    write_hf_directory(path, tmp_path / "out")
    assert recorder.calls == [path]


def test_a_file_missing_a_weight_is_refused_not_initialised_at_random(tmp_path):
    gguf_path = tiny_gemma3_gguf(tmp_path, drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"no weights for model\.layers\.1\.mlp\.up_proj"):
        write_hf_directory(gguf_path, tmp_path / "out")


def test_regrouped_dequantisation_matches_gguf_py_row_by_row(tmp_path):
    """Blocks regrouped into long rows dequantise to the values of the file's own rows."""
    rows, cols = 300, 512  # Q8_0's 4800 blocks regroup into rows of 1600: three rows of 100
    qtypes = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)
    tensors = {f"t{index}.weight": ((rows, cols), qtype) for index, qtype in enumerate(qtypes)}
    path = write_gguf(tmp_path / "formats.gguf", "llama", {}, {}, tensors)
    header = read_header(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    reader = gguf.GGUFReader(path)
    for tensor, reference in zip(header.tensors, reader.tensors, strict=True):
        expected = gguf.quants.dequantize(reference.data, reference.tensor_type)
        actual = gguf_convert._dequantize(blob, header.data_start, tensor)
        assert actual.shape == expected.shape == (rows, cols)
        np.testing.assert_array_equal(actual, expected, strict=True)


@pytest.mark.parametrize(
    ("make_gguf", "heads", "interleaved"),
    [(tiny_llama_gguf, (4, 2), True), (tiny_gemma3_gguf, (2, 1), False)],
)
def test_blocks_are_read_from_the_fast_header_as_gguf_py_reads_them(
    make_gguf, heads, interleaved, tmp_path, monkeypatch
):
    # quantization native maps the file's blocks from the header this module parses; gguf-py's
    # GGUFReader (the fallback) must find the same modules, formats and bytes.
    gguf_path = make_gguf(tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(gguf, "GGUFReader", no_gguf_reader)
        fast, fast_skipped = read_blocks(gguf_path, *heads, interleaved)
    with monkeypatch.context() as patched:
        patched.setattr(gguf_blocks, "read_header", lambda path: None)
        reference, skipped = read_blocks(gguf_path, *heads, interleaved)
    assert fast.keys() == reference.keys() and fast_skipped == skipped
    assert "model.embed_tokens" in fast and len(fast) > 2 * NUM_LAYERS
    for name, weights in fast.items():
        expected = reference[name] if isinstance(weights, tuple) else (reference[name],)
        for got, want in zip(
            weights if isinstance(weights, tuple) else (weights,), expected, strict=True
        ):
            assert (got.format, got.in_features) == (want.format, want.in_features), name
            assert torch.equal(got.data, want.data), name


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    gguf_path = tiny_gemma3_gguf(tmp_path)
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[: len(data) - 4096])  # the last tensors cut short
    assert read_header(gguf_path) is not None  # the header still parses
    with pytest.raises(ModelLoadError, match="ends inside its tensor"):
        read_blocks(gguf_path, 2, 1, False)
