"""Offline throughput: kvshare's engine vs HF transformers `generate` on the same weights.

Workload: N prompts of about P tokens, each generating exactly O tokens (EOS ignored).
Rows, measured in one run on the same machine:
  - kvshare engine, up to C concurrent sequences, fp32 and bf16
  - kvshare engine, one sequence (per-token decode time)
  - HF generate, one prompt at a time (fp32), on a subset of the prompts
  - HF generate, padded static batches of 8 (fp32)

Each row runs in a fresh Python process, one after another: no row inherits another's
allocator state, thread pools or warm caches (kvshare tunes glibc malloc for its process;
HF runs with the defaults a user gets).

Usage: python benchmarks/offline_throughput.py [--num-prompts 64 --prompt-len 240
       --output-len 64 --concurrency 32 --hf-single-prompts 8 --threads 2 --repeats 1
       --out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.loader import resolve_model_dir

_TOPICS = [
    "the history of tea trade routes",
    "how bridges carry load",
    "the life cycle of stars",
    "why rivers meander",
    "the economics of small bakeries",
    "how vaccines train immunity",
    "the design of mechanical clocks",
    "migration patterns of arctic terns",
]


def build_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Distinct prompts of exactly prompt_len tokens (no shared prefix beyond a few tokens)."""
    prompts = []
    for i in range(num_prompts):
        topic = _TOPICS[i % len(_TOPICS)]
        text = f"Essay {i} on {topic}. " + " ".join(
            f"Point {j}: consider {topic} from angle {i * 7 + j}, and what follows from it."
            for j in range(60)
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_len]
        assert len(ids) == prompt_len, "prompt text too short for the requested length"
        prompts.append(ids)
    return prompts


def run_engine(model_dir: str, dtype: str, prompts, output_len: int, concurrency: int) -> dict:
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        max_num_seqs=concurrency,
        max_num_batched_tokens=2048,
        enable_prefix_cache=False,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate([prompts[0][:16]], params)  # warm-up
    engine.step_samples.clear()
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    steps = list(engine.step_samples)
    num_out = sum(len(r.token_ids[0]) for r in results)
    assert num_out == len(prompts) * output_len
    decode_steps = [s.duration_s for s in steps if s.num_tokens == s.num_seqs]
    return {
        "output_tokens_per_s": num_out / elapsed,
        "elapsed_s": elapsed,
        "decode_step_ms_median": 1000 * statistics.median(decode_steps) if decode_steps else None,
    }


def run_engine_single(model_dir: str, dtype: str, prompt, output_len: int) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate([prompt[:16]], params)
    engine.step_samples.clear()
    engine.generate([prompt], params)
    decode = [s.duration_s for s in engine.step_samples if s.num_tokens == 1]
    return {"decode_ms_per_token": 1000 * statistics.median(decode)}


def run_hf(model_dir: str, prompts, output_len: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False)
        started = time.perf_counter()
        per_token = []
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            pad = model.generation_config.pad_token_id
            pad = pad[0] if isinstance(pad, list) else pad
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, **kwargs)
            per_token.append((time.perf_counter() - t0) / output_len)
        elapsed = time.perf_counter() - started
    return {
        "output_tokens_per_s": len(prompts) * output_len / elapsed,
        "elapsed_s": elapsed,
        "ms_per_output_step": 1000 * statistics.median(per_token),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir; default: embedded SmolLM2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=240)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hf-single-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row; medians")
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    model_dir = str(resolve_model_dir(EngineConfig(model=args.model)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = build_prompts(tokenizer, args.num_prompts, args.prompt_len)

    jobs = {}
    for dtype in ("float32", "bfloat16"):
        jobs[f"kvshare {dtype}, {args.concurrency} concurrent"] = (
            run_engine,
            model_dir,
            dtype,
            prompts,
            args.output_len,
            args.concurrency,
        )
    for dtype in ("float32", "bfloat16"):
        jobs[f"kvshare {dtype}, 1 sequence"] = (
            run_engine_single,
            model_dir,
            dtype,
            prompts[0],
            args.output_len,
        )
    if not args.skip_hf:
        jobs["HF generate fp32, one at a time"] = (
            run_hf,
            model_dir,
            prompts[: args.hf_single_prompts],
            args.output_len,
            1,
        )
        jobs["HF generate fp32, static batches of 8"] = (
            run_hf,
            model_dir,
            prompts,
            args.output_len,
            8,
        )
    # Every repeat runs all rows in turn, so a noisy spell on a shared machine hits every row;
    # the table shows each figure's median over the repeats.
    runs: dict[str, list[dict]] = {name: [] for name in jobs}
    for repeat in range(args.repeats):
        for name, (fn, *fn_args) in jobs.items():
            runs[name].append(in_fresh_process(args.threads, fn, *fn_args))
            print(f"repeat {repeat + 1}/{args.repeats}: {name}: {runs[name][-1]}", flush=True)
    rows = {name: median_row(results) for name, results in runs.items()}
    print_table(rows, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=2)
    )


def median_row(results: list[dict]) -> dict:
    """Each field's median over the repeats (None where no repeat measured it)."""
    row = {}
    for key in results[0]:
        values = [r[key] for r in results if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    return row


def in_fresh_process(num_threads: int, fn, *fn_args) -> dict:
    """fn(*fn_args) in a new interpreter (spawned, not forked) with num_threads torch threads."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_with_threads, (num_threads, fn, *fn_args))


def _with_threads(num_threads: int, fn, *fn_args) -> dict:
    torch.set_num_threads(num_threads)
    return fn(*fn_args)


def print_table(rows: dict[str, dict], args: argparse.Namespace) -> None:
    base = rows.get("HF generate fp32, one at a time", {}).get("output_tokens_per_s")
    print(
        f"\n{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output "
        f"tokens each, {args.threads} threads\n"
    )
    print("| run | output tok/s | vs HF one-at-a-time | decode ms/step |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        tps = row.get("output_tokens_per_s")
        ratio = f"{tps / base:.2f}x" if tps and base else "-"
        step = row.get("decode_step_ms_median") or row.get("decode_ms_per_token")
        step = step or row.get("ms_per_output_step")
        print(
            f"| {name} | {tps:.1f} | {ratio} | {step:.1f} |"
            if tps
            else f"| {name} | - | - | {step:.1f} |"
        )


if __name__ == "__main__":
    main()
