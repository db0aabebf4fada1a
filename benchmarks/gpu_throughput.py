"""GPU throughput: kvshare's engine vs HF transformers on a random-weight ~1B Llama (no download).

Model: a Llama-architecture config (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192,
vocab 32000: about 1.1B parameters), random bf16 weights, saved to a temporary directory.
Workload: B prompts of P random tokens, each generating exactly O tokens (EOS ignored).
Measured in one run:
  - copy bandwidth (a large device-to-device copy) and the batch-1 decode bound it implies:
    bytes of weights read per decode step / bandwidth
  - kvshare: median decode step time at batch 1 (vs that bound), output tokens/s at each B
  - HF transformers: `generate` (one static batch) and `generate_batch` (continuous batching,
    where this transformers has it) on the same prompts
Prints a Markdown table and writes JSON. Goals: batch-1 decode within 2x of the bound;
throughput at the largest batch at least 3x HF's best.

Usage: python benchmarks/gpu_throughput.py [--batch-sizes 64 256 --prompt-len 128
       --output-len 128 --out gpu_throughput.json]
       python benchmarks/gpu_throughput.py --device cpu --tiny   (a smoke run on the CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FULL_CONFIG = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096,
)  # fmt: skip
TINY_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=256,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and workload (smoke run)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--batch1-steps", type=int, default=None, help="decode steps timed at B=1")
    parser.add_argument("--skip-hf", action="store_true", help="only the kvshare engine")
    parser.add_argument("--out", default="gpu_throughput.json", help="JSON results file")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_sizes = args.batch_sizes or ([2, 4] if tiny else [64, 256])
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.output_len = args.output_len or (8 if tiny else 128)
    args.batch1_steps = args.batch1_steps or (8 if tiny else 64)
    return args


_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(tiny: bool, dtype: torch.dtype, device: torch.device, model_dir: Path):
    """A random-weight LlamaForCausalLM on `device`, saved (with a word-level tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY_CONFIG if tiny else FULL_CONFIG), tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)  # benchmark weights only; never on the serving path
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(model_dir)
    save_tokenizer(config.vocab_size, model_dir)
    return model


def save_tokenizer(vocab_size: int, model_dir: Path) -> None:
    """A word-level tokenizer over "<i>" tokens, in case a loader wants tokenizer files."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>",
                                   pad_token="<0>", unk_token="<0>")  # fmt: skip
    fast.save_pretrained(model_dir)


def decode_weight_bytes(model) -> int:
    """Bytes one decode step must read: every weight except the embedding table (one row)."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embedding.numel() * embedding.element_size()


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s moved by a large tensor copy (each byte read once and written once)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    synchronize(device)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * src.element_size() / min(times)


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # random ids: no two prompts share a prefix worth caching
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


def greedy_params(output_len: int):
    from engine.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_requests(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[int, list]:
    """Drive add_request/step to completion: (output tokens, [(step seconds, num seqs)])."""
    from engine.core.protocol import EngineRequest

    for i, prompt in enumerate(prompts):
        params = greedy_params(output_len)
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    num_tokens, steps = 0, []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - started, len(outputs)))
        for output in outputs:
            if output.error:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            num_tokens += sum(len(c.new_token_ids) for c in output.outputs)
    return num_tokens, steps


def bench_engine(args: argparse.Namespace, model_dir: Path, vocab_size: int, results: dict) -> None:
    """Fill `results` as measurements come in: batch-1 decode step time, tokens/s per batch."""
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, device=args.device,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=8192 if args.device == "cuda" else 2048,
        kv_cache_bytes=(256 << 20) if args.device == "cpu" else None,
        gpu_memory_utilization=0.5,  # leaves room for the HF baselines in the same process
    )  # fmt: skip
    log("kvshare: loading the engine")
    engine = LLMEngine(config)
    log("kvshare: warm-up and batch 1")
    run_requests(engine, make_prompts(2, args.prompt_len, vocab_size, 99), 4, "warmup")
    prompt = make_prompts(1, args.prompt_len, vocab_size, 1)
    _, steps = run_requests(engine, prompt, args.batch1_steps + 1, "b1")
    results["batch1_decode_step_s"] = statistics.median(s for s, _ in steps[1:])
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab_size, seed=batch)
        log(f"kvshare: batch {batch}")
        started = time.perf_counter()
        num_tokens, _ = run_requests(engine, prompts, args.output_len, f"b{batch}")
        elapsed = time.perf_counter() - started
        assert num_tokens == batch * args.output_len, (num_tokens, batch * args.output_len)
        results[f"batch{batch}_tokens_per_s"] = num_tokens / elapsed
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()


def bench_hf_generate(model, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of one padded-free static batch through `generate` (greedy)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        warmup = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **warmup)
        synchronize(device)
        started = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        synchronize(device)
    elapsed = time.perf_counter() - started
    return (out.shape[1] - input_ids.shape[1]) * len(prompts) / elapsed


def bench_hf_generate_batch(model, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s through transformers' continuous batching `generate_batch`."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, eos_token_id=-1, pad_token_id=0)  # fmt: skip
    device = next(model.parameters()).device
    with torch.inference_mode():
        model.generate_batch(inputs=prompts[:2], generation_config=config)  # warm-up
        synchronize(device)
        started = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
        synchronize(device)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return num_tokens / elapsed


def bench_hf(args: argparse.Namespace, model, vocab_size: int, results: dict, save) -> None:
    """`generate` at every batch size, then `generate_batch` (the riskier one) at every size."""
    for name, fn in (("generate", bench_hf_generate), ("generate_batch", bench_hf_generate_batch)):
        for batch in args.batch_sizes:
            if name == "generate_batch" and not hasattr(model, "generate_batch"):
                results[f"{name}_batch{batch}_error"] = "not in this transformers"
                continue
            log(f"HF {name}, batch {batch}")
            prompts = make_prompts(batch, args.prompt_len, vocab_size, seed=batch)
            try:
                results[f"{name}_batch{batch}_tokens_per_s"] = fn(model, prompts, args.output_len)
            except Exception as exc:  # a baseline failing must not hide the other numbers
                results[f"{name}_batch{batch}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            save()


def markdown_table(result: dict) -> str:
    ours, hf = result.get("kvshare", {}), result.get("hf", {})
    bound = result["batch1_bound_s"]
    model = f"{result['num_params'] / 1e6:.1f}M params, {result['dtype']}, {result['device_name']}"
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| model | {model} |",
        f"| copy bandwidth | {result['copy_bandwidth_gbs']:.0f} GB/s |",
        f"| batch-1 decode bound (weights / bandwidth) | {bound * 1e3:.2f} ms |",
    ]
    step = ours.get("batch1_decode_step_s")
    if step is not None:
        lines.append(
            f"| kvshare batch-1 decode step | {step * 1e3:.2f} ms ({step / bound:.2f}x bound) |"
        )
    if "error" in ours:
        lines.append(f"| kvshare error | {ours['error']} |")
    for batch in result["batch_sizes"]:
        ours_tps = ours.get(f"batch{batch}_tokens_per_s")
        lines.append(f"| kvshare batch {batch} | {_tokens_per_s(ours_tps, None)} |")
        hf_best = 0.0
        for name in ("generate", "generate_batch"):
            value = hf.get(f"{name}_batch{batch}_tokens_per_s")
            error = hf.get(f"{name}_batch{batch}_error")
            lines.append(f"| HF {name} batch {batch} | {_tokens_per_s(value, error)} |")
            hf_best = max(hf_best, value or 0.0)
        if hf_best and ours_tps:
            lines.append(f"| kvshare / HF best, batch {batch} | {ours_tps / hf_best:.2f}x |")
    return "\n".join(lines)


def _tokens_per_s(value: float | None, error: str | None) -> str:
    return f"{value:.0f} tok/s" if value is not None else f"n/a ({error or 'not run'})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="kvshare-gpu-bench-") as tmp:
        model_dir = Path(tmp) / "random-llama"
        log(f"building a random model on {device}")
        model = build_model(args.tiny, getattr(torch, args.dtype), device, model_dir)
        vocab_size = model.config.vocab_size
        weight_bytes = decode_weight_bytes(model)
        bandwidth = copy_bandwidth(device, (64 << 20) if args.tiny else (2 << 30))
        result = {
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": args.dtype, "num_params": sum(p.numel() for p in model.parameters()),
            "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "decode_weight_bytes": weight_bytes,
            "copy_bandwidth_gbs": bandwidth / 1e9, "batch1_bound_s": weight_bytes / bandwidth,
            "kvshare": {}, "hf": {},
        }  # fmt: skip
        # ours first (a baseline that hangs must not cost our numbers); JSON after each phase
        try:
            bench_engine(args, model_dir, vocab_size, result["kvshare"])
        except Exception as exc:
            result["kvshare"]["error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"kvshare failed: {result['kvshare']['error']}")
        gc.collect()
        out.write_text(json.dumps(result, indent=2) + "\n")
        if not args.skip_hf:
            bench_hf(args, model, vocab_size, result["hf"], lambda: out.write_text(
                json.dumps(result, indent=2) + "\n"))  # fmt: skip
    print(markdown_table(result))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0 if "error" not in result["kvshare"] else 1


if __name__ == "__main__":
    sys.exit(main())
