"""Speculative decoding (n-gram prompt lookup): output tok/s with and without, offline engine.

Workloads (SmolLM2-135M-Instruct, chat-templated, greedy, fixed output length):
  - edit: "rewrite this code / text with a small change": the answer copies the prompt, so
    drafts from the prompt are often right (the case prompt lookup is for);
  - chat: the short unique questions of benchmarks/questions.py (answers rarely repeat the prompt).
Each (workload, batch) runs without speculation, then with it, in one engine each, and the
token ids are compared (they must be equal: speculation is exact).

Usage: python benchmarks/spec_decode.py [--batches 1 8 --output-len 96 --k 4 --min-n 2
       --max-n 4 --threads 2 --out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.questions import QUESTIONS
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.loader import resolve_model_dir

_CODE = '''def moving_average(values, window):
    """Average of each window of consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    totals = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            totals.append(running / window)
    return totals
'''
_EDITS = [
    "Rename the function moving_average to rolling_mean and change nothing else. "
    "Answer with the whole code.",
    "Rename the variable running to acc and change nothing else. Answer with the whole code.",
    "Add type hints to the function signature and change nothing else. Answer with the whole code.",
    "Rename the argument window to size everywhere and change nothing else. "
    "Answer with the whole code.",
]


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def workloads(tokenizer, batch: int) -> dict[str, list[list[int]]]:
    edits = [f"{_CODE}\n{_EDITS[i % len(_EDITS)]}" for i in range(batch)]
    return {
        "edit": chat_prompts(tokenizer, edits),
        "chat": chat_prompts(tokenizer, QUESTIONS[:batch]),
    }


def run(model_dir: str, prompts, output_len: int, threads: int, k: int, min_n: int, max_n: int):
    config = EngineConfig(
        model=model_dir,
        dtype="float32",
        num_threads=threads,
        max_num_seqs=max(8, len(prompts)),
        max_num_batched_tokens=512,
        enable_prefix_cache=False,
        speculative_ngram_tokens=k,
        speculative_ngram_min=min_n,
        speculative_ngram_max=max_n,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    before = engine.stats()
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    drafted = stats.num_spec_draft_tokens - before.num_spec_draft_tokens
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    num_tokens = sum(len(r.token_ids[0]) for r in results)
    return {
        "tokens": [r.token_ids[0] for r in results],
        "tok_s": num_tokens / elapsed,
        "ms_per_step_token": 1000 * elapsed / (num_tokens / len(prompts)),
        "draft_tokens": drafted,
        "acceptance": accepted / drafted if drafted else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["edit", "chat"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = str(resolve_model_dir(EngineConfig()))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for batch in args.batches:
        for name, prompts in workloads(tokenizer, batch).items():
            if name not in args.workloads:
                continue
            base = run(model_dir, prompts, args.output_len, args.threads, 0, 1, 1)
            spec = run(model_dir, prompts, args.output_len, args.threads, args.k, args.min_n,
                       args.max_n)  # fmt: skip
            row = {
                "workload": name,
                "batch": batch,
                "tok_s_off": round(base["tok_s"], 1),
                "tok_s_on": round(spec["tok_s"], 1),
                "speedup": round(spec["tok_s"] / base["tok_s"], 2),
                "acceptance": round(spec["acceptance"], 3),
                "draft_tokens": spec["draft_tokens"],
                "identical": base["tokens"] == spec["tokens"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
