"""Cost of the prefix-cache audit: shared-prefix throughput with the audit off, at 1% and 100%.

One process, one set of weights: the settings take turns (off, 0.01, 1.0, off, ...) for
--repeats rounds, so that machine noise hits them alike; the prefix cache is emptied before
every run. Workload: benchmarks/serving.py's shared-prefix conversations (one ~200-token
system prompt, a different short question each) through the chat template, all submitted at
once to the offline LLMEngine (up to --concurrency sequences at a time). Prints a Markdown
table: output tokens/s (median of the rounds), relative to audit off, and what the audits of
those runs found (verdicts, the largest relative error, dropped audits).

    python benchmarks/audit_overhead.py --num-requests 6 --max-tokens 8 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import build_workload
from engine.audit.auditor import Auditor
from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.loader import resolve_model_dir

RATES = (0.0, 0.01, 1.0)


def build_prompts(model_dir: str, num_requests: int, max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for conversation in build_workload("shared-prefix", num_requests, max_tokens, seed=0):
        messages = [
            {"role": "system", "content": conversation.system_prompt},
            {"role": "user", "content": conversation.user_turns[0]},
        ]
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        prompts.append(list(encoded["input_ids"]))
    return prompts


def set_audit_rate(engine: LLMEngine, rate: float) -> None:
    """A fresh auditor sampling `rate` of the cache hits (the same weights and pool)."""
    engine.config = dataclasses.replace(engine.config, audit_sample_rate=rate)
    engine.scheduler.record_cache_hits = rate > 0
    engine.auditor = Auditor(
        engine.config, engine.runner, engine.kv_cache_manager, engine.scheduler.get_seq
    )


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str):
    """Submit every prompt at once, step until requests and audits are done."""
    engine.kv_cache_manager.prefix_cache.reset()  # every run starts from an empty cache
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    num_output_tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            num_output_tokens += sum(len(c.new_token_ids) for c in output.outputs)
    elapsed = time.perf_counter() - started
    assert num_output_tokens == len(prompts) * params.max_tokens
    return num_output_tokens / elapsed, engine.stats(), list(engine.auditor.recent_results)


def measure(engine: LLMEngine, prompts, params, repeats: int) -> dict[float, dict]:
    rows = {rate: {"tok_s": [], "stats": [], "results": []} for rate in RATES}
    for round_index in range(repeats):
        for rate in RATES:  # interleaved: drift of the machine spreads over every setting
            set_audit_rate(engine, rate)
            tok_s, stats, results = run_once(engine, prompts, params, f"r{round_index}-{rate}")
            rows[rate]["tok_s"].append(tok_s)
            rows[rate]["stats"].append(stats)
            rows[rate]["results"] += results
            print(f"round {round_index} rate {rate}: {tok_s:.1f} tok/s", file=sys.stderr)
    return rows


def format_markdown(rows: dict[float, dict], args: argparse.Namespace) -> str:
    base = statistics.median(rows[0.0]["tok_s"])
    lines = [
        f"Shared-prefix workload, {args.num_requests} requests x {args.max_tokens} output tokens,"
        f" concurrency {args.concurrency}, {args.dtype}, {args.repeats} interleaved rounds.",
        "",
        "| audit sample rate | output tok/s (median) | vs off | runs (tok/s) | audits | "
        "clean / drift / corruption | max rel. error | dropped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate, row in rows.items():
        median = statistics.median(row["tok_s"])
        verdicts = Counter(result.verdict.value for result in row["results"])
        max_error = max((result.max_error for result in row["results"]), default=None)
        lines.append(
            f"| {'off' if rate == 0 else rate} | {median:.2f} | {median / base - 1:+.1%} | "
            f"{', '.join(f'{v:.2f}' for v in row['tok_s'])} | "
            f"{sum(s.num_audits for s in row['stats'])} | "
            f"{verdicts['clean']} / {verdicts['drift']} / {verdicts['corruption']} | "
            f"{'-' if max_error is None else f'{max_error:.2e}'} | "
            f"{sum(s.num_audits_dropped for s in row['stats'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir; default: embedded SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_dir(EngineConfig(model=args.model)))
    prompts = build_prompts(model_dir, args.num_requests, args.max_tokens)
    config = EngineConfig(
        model=model_dir, dtype=args.dtype, device="cpu",
        num_kv_blocks=1024, max_num_seqs=args.concurrency, max_num_batched_tokens=512,
        audit_max_pending=args.num_requests,  # at 1.0, audit every hit: none is dropped
    )  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    run_once(engine, prompts[:2], params, "warm-up")
    print(format_markdown(measure(engine, prompts, params, args.repeats), args))


if __name__ == "__main__":
    main()
