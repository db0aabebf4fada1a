"""Write a GGUF file out as a safetensors HF directory: the files transformers would write.

transformers' conversion (`from_pretrained(folder, gguf_file=...)`) parses the whole file with
gguf-py's GGUFReader three times (model config, weights, tokenizer config), and that reader walks
a large vocabulary one numpy view at a time. For FAST_ARCHITECTURES this module parses the header
once with transformers' fast reader and runs the rest of transformers' conversion on it: its
config mapping, gguf-py's name map and dequantisation, the per-architecture tensor fixes,
save_pretrained and the tokenizer converter. tests/engine/runtime/test_gguf_convert.py holds the
output equal to transformers'. Any other file is converted by transformers itself.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.core.errors import ModelLoadError
from engine.runtime.cpu.gguf_header import GgufHeader, GgufTensor, read_header

logger = logging.getLogger(__name__)

# Architectures transformers converts through its legacy GGUF loader (load_gguf_checkpoint),
# which _config_dict and _read_weights reproduce.
FAST_ARCHITECTURES = frozenset({"llama", "gemma3"})

_ELEMENTS_PER_ROW = 1 << 16  # per row handed to gguf-py's dequantize: 1M-element groups of 16


def write_hf_directory(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` into `out_dir`: config.json, model.safetensors, tokenizer files
    and generation_config.json, as transformers writes them."""
    header = read_header(gguf_path)
    if header is None or not _is_fast_path_covered(header):
        write_with_transformers(gguf_path, out_dir)
        return
    try:
        config_dict = _config_dict(header)
        model = _meta_model(config_dict)
        _load_weights(model, _read_weights(gguf_path, header, model, config_dict), gguf_path)
        model.save_pretrained(out_dir)
        _save_tokenizer(gguf_path, model.config, out_dir)
        model.generation_config.save_pretrained(out_dir)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' internals this path uses moved: its own way works
        logger.warning("fast GGUF conversion failed (%s); converting with transformers", exc)
        shutil.rmtree(out_dir, ignore_errors=True)
        write_with_transformers(gguf_path, out_dir)


def _is_fast_path_covered(header: GgufHeader) -> bool:
    # The legacy loader turns a llama file named exactly "mistral" into a Mistral model.
    is_mistral = header.metadata.get("general.name") == "mistral"
    return header.architecture in FAST_ARCHITECTURES and not is_mistral


def _config_dict(header: GgufHeader) -> dict[str, Any]:
    """The config dict load_gguf_checkpoint builds from the file's metadata."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    tensor_names = {tensor.name for tensor in header.tensors}
    config = {
        **GGUF_CONFIG_DEFAULTS_MAPPING.get(header.architecture, {}),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for key, value in header.metadata.items():
        prefix, _, gguf_name = key.partition(".")
        config_key = GGUF_CONFIG_MAPPING.get(prefix, {}).get(gguf_name)
        if config_key is None or config_key == -1:
            continue
        # the legacy reader unwraps a one-element array
        config[config_key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"  # a Gemma 3 GGUF holds the text backbone only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.metadata:
        config["vocab_size"] = header.metadata["tokenizer.ggml.tokens"]  # the vocabulary's length
    return config


def _meta_model(config_dict: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_dict)
    # On meta: every weight is replaced by the file's, so none is allocated or initialised here.
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _read_weights(
    gguf_path: Path, header: GgufHeader, model: torch.nn.Module, config_dict: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The model's float32 weights, named and fixed up as load_gguf_checkpoint does."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config_dict)
    hf_names = _hf_names(model, header.architecture)
    blob = np.memmap(gguf_path, mode="r", dtype=np.uint8)
    weights: dict[str, torch.Tensor] = {}
    for tensor in header.tensors:
        result = processor.process(
            weights=_dequantize(blob, header.data_start, tensor),
            name=tensor.name,
            tensor_key_mapping=hf_names,
            parsed_parameters={"tensors": weights},
        )
        if result.name in hf_names:
            # copied only where still a view of the read-only file
            array = np.require(result.weights, requirements=("C", "W"))
            weights[hf_names[result.name]] = torch.from_numpy(array)
    return weights


def _hf_names(model: torch.nn.Module, architecture: str) -> dict[str, str]:
    """{GGUF tensor name: HF parameter name}, as get_gguf_hf_weights_map maps them.

    For FAST_ARCHITECTURES gguf-py's name map resolves every HF name from the top module, so this
    is the first step of transformers' walk, which rebuilds the map for every submodule (seconds).
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    hf_names = {}
    for hf_name in model.state_dict():
        stem, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            stem, dot, kind = hf_name.rpartition(".")
            suffix = dot + kind
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            hf_names[gguf_name + suffix] = hf_name
    return hf_names


def _dequantize(blob: np.ndarray, data_start: int, tensor: GgufTensor) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    ggml_type = GGMLQuantizationType(tensor.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    num_blocks = math.prod(tensor.shape) // block_size
    start = data_start + tensor.offset
    raw = blob[start : start + num_blocks * type_size]
    if ggml_type == GGMLQuantizationType.F32:
        return dequantize(raw.view(np.float32).reshape(tensor.shape), ggml_type)
    if ggml_type == GGMLQuantizationType.F16:
        return dequantize(raw.view(np.float16).reshape(tensor.shape), ggml_type)
    # dequantize works block by block, in a Python loop over groups of 16 rows: regrouping the
    # blocks into long rows gives the same values from far fewer, larger numpy calls.
    blocks_per_row = _largest_divisor(num_blocks, _ELEMENTS_PER_ROW // block_size)
    rows = raw.reshape(num_blocks // blocks_per_row, blocks_per_row * type_size)
    return dequantize(rows, ggml_type).reshape(tensor.shape)


def _largest_divisor(number: int, at_most: int) -> int:
    if number == 0:  # an empty tensor: one (empty) row
        return 1
    return next(d for d in range(min(number, max(at_most, 1)), 0, -1) if number % d == 0)


def _load_weights(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], gguf_path: Path
) -> None:
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if missing:
        # transformers would initialise these at random; a served model must not be
        raise ModelLoadError(f"{gguf_path.name} holds no weights for {', '.join(missing)}")


def _save_tokenizer(gguf_path: Path, config: Any, out_dir: Path) -> None:
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    folder, name = str(gguf_path.parent), gguf_path.name
    if (gguf_path.parent / "tokenizer_config.json").exists():  # AutoTokenizer reads its class there
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        # The class AutoTokenizer picks for such a GGUF, named without it parsing the whole file
        # again to learn the config we already have.
        tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
        tokenizer = tokenizer_class.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)


def write_with_transformers(gguf_path: Path, out_dir: Path) -> None:
    """transformers' own conversion: the fallback, and what the fast path is tested against."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are plain dequantised tensors now; drop the GGUF marks so they save as such.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out_dir)
