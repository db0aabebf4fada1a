"""Quality and speed of each quantization mode against the exact one (quantization none).

Quality, teacher-forced on benchmarks/quality_text.txt (an original text written for this
benchmark, public domain, 2,140 SmolLM2 tokens), through the engine's own model runner
(engine/runtime/quant_quality.py): top-1 agreement with the exact model (goal >= 0.98)
and the perplexity ratio (goal <= 1.02).

Speed, engine offline (LLMEngine.generate, greedy, EOS ignored, prefix cache off): the median
decode step at batch 1 and at batch 8, and the ms per output token it gives (step / batch).

A mode may name a KV cache dtype after a colon: native:float16 is quantization native over a
float16 KV pool (kv_cache_dtype), against the exact mode's float32 one.

Usage: python benchmarks/quality.py [--model gemma-3-270m] [--modes none,fp16,int8,native:float16
       --threads 2 --output-len 32 --chunk-tokens 256 --out benchmarks/results/quality.json]
(--model: any `kvshare serve --model` value; default the embedded SmolLM2.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.config import QUANTIZATIONS, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.loader import resolve_model_dir
from engine.runtime.quant_quality import TextScore, compare, score_text

TEXT = Path(__file__).resolve().parent / "quality_text.txt"
PROMPT_TOKENS = 64  # each speed prompt: a slice of the text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as kvshare serve --model (default SmolLM2)")
    parser.add_argument("--modes", default=",".join(QUANTIZATIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def make_engine(mode: str, args: argparse.Namespace, max_num_seqs: int) -> LLMEngine:
    quantization, _, kv_cache_dtype = mode.partition(":")
    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            device="cpu",
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype or "auto",
            num_threads=args.threads,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=1024,
            enable_prefix_cache=False,
        )
    )


def decode_ms(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Median decode step (every sequence decoding) in ms, for len(prompts) sequences."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate([prompts[0][:8]], params)  # warm-up
    engine.step_samples.clear()
    engine.generate(prompts, params)
    batch = len(prompts)
    steps = [s.duration_s for s in engine.step_samples if s.num_tokens == s.num_seqs == batch]
    return 1000 * statistics.median(steps)


def measure(mode: str, token_ids: list[int], args: argparse.Namespace) -> dict:
    engine = make_engine(mode, args, max_num_seqs=8)
    score = score_text(engine.runner, token_ids, args.chunk_tokens)
    # Where prompt and generated tokens take different kernel paths (AMX tiles for the prompt,
    # step_inputs.tile_rows), the text is also scored on the generated tokens' path.
    generated = None
    if engine.runner.tile_prompts:
        generated = score_text(engine.runner, token_ids, args.chunk_tokens, as_prompt=False)
    prompts = [token_ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(8)]
    step_1 = decode_ms(engine, prompts[:1], args.output_len)
    step_8 = decode_ms(engine, prompts, args.output_len)
    engine.close()
    return {
        "score": score,
        "generated": generated,
        "step_ms_batch1": step_1,
        "step_ms_batch8": step_8,
    }


def row(mode: str, exact: TextScore, result: dict) -> dict:
    agreement = compare(exact, result["score"])
    return {
        "mode": mode,
        "positions": agreement.num_positions,
        "top1_agreement": round(agreement.top1_agreement, 4),
        "perplexity": round(agreement.perplexity, 4),
        "perplexity_ratio": round(agreement.perplexity_ratio, 4),
        "ms_per_token_batch1": round(result["step_ms_batch1"], 2),
        "step_ms_batch8": round(result["step_ms_batch8"], 2),
        "ms_per_token_batch8": round(result["step_ms_batch8"] / 8, 2),
    }


def print_table(rows: list[dict]) -> None:
    print("| mode | positions | top-1 agreement | perplexity | ratio | ms/token b1 | step ms b8 "
          "| ms/token b8 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['positions']} | {r['top1_agreement']:.4f} | "
            f"{r['perplexity']:.3f} | {r['perplexity_ratio']:.4f} | {r['ms_per_token_batch1']} | "
            f"{r['step_ms_batch8']} | {r['ms_per_token_batch8']} |"
        )


def main() -> None:
    args = parse_args()
    modes = ["none", *(m for m in args.modes.split(",") if m != "none")]  # exact first
    model_dir = resolve_model_dir(EngineConfig(model=args.model))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    token_ids = tokenizer(TEXT.read_text())["input_ids"]
    results = {}
    for mode in modes:
        results[mode] = measure(mode, token_ids, args)
        gc.collect()  # one engine's weights and KV pool at a time
    exact = results["none"]["score"]
    rows = [row(mode, exact, results[mode]) for mode in results]
    rows += [
        row(f"{mode}, generated-token path", exact, {**result, "score": result["generated"]})
        for mode, result in results.items()
        if result["generated"] is not None
    ]
    print(f"model {model_dir.name}; text: {TEXT.name}, {len(token_ids)} tokens; "
          f"torch {torch.__version__}, {args.threads} threads")  # fmt: skip
    print_table(rows)
    if args.out is not None:
        args.out.write_text(json.dumps({"tokens": len(token_ids), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
