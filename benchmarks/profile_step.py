"""Step profile: where one engine step goes on the CPU, each part beside this machine's bound.

    python benchmarks/profile_step.py [--repo DIR] [--steps 8] [--http-batches 1 8] \
        [--quantization none] [--native-decode off] [--out benchmarks/results/profile_after.json]

The default model (SmolLM2-135M-Instruct) with config/cpu.yaml's engine settings, in an offline
LLMEngine: decode steps at 1, 8 and 32 sequences (~240-token prompts) and one 512-token
prefill chunk. `--repo` names the source tree to profile (default: this one), so the same
script profiles an older commit's worktree; it uses no engine API newer than that. Drafting
(speculative_ngram_tokens) is off whatever cpu.yaml says, so a "decode, batch N" step computes
exactly N rows, one token per sequence: the step the bandwidth fraction is stated for.

Buckets. The script wraps these callables in its own process (timing hooks; nothing in the
engine changes) and adds each call's wall time to its bucket; calls nested inside a timed call
count for the outer one only:
  projections   q/k/v, o, gate/up and down linears (PackedLinear / nn.Linear forward)
  attention     the backend's store_kv and forward (KV writes and paged attention; where
                rope is fused into the KV store, CpuFusedOps.rope_store, that too)
  elementwise   RMSNorm, rope, SiLU-and-mul (fused or torch), embedding and rope-table lookups
  native layers a step's whole layer stack in one native call (NativeDecodeStep.run,
                quantization native / q8_0): projections, attention and elementwise together
  LM head       compute_logits (the [N, E] x [E, V] matmul), or greedy_tokens where greedy rows
                take their tokens from GreedyHead (newer trees)
  sampling      the sampler
  scheduling    scheduler.schedule and update_from_output
  Python/glue   the rest of the step (layer, runner and engine code between those calls:
                dispatch, views, residual adds, input tensors), minus the timers' own cost
                (calibrated: per wrapped call, times the calls per step)

Bounds, measured here first: read bandwidth (a large tensor's sum) and the best GEMM rate
(F.linear / packed oneDNN at 512 rows). A bucket's bound is max(bytes it must move / bandwidth,
FLOPs / GEMM rate): weights and KV are read once, activations read and written once. Weight
bytes are those the model holds (GGUF blocks, fp16, fp32), so "weights GB/s" = the weight bytes a
step reads / the step's time, and its fraction of the measured read bandwidth, are the figures
the CPU-speed goal is stated in.

The HTTP front end's share: the same requests (token-id prompts, 64 output tokens, ignore_eos)
run offline and over a real `kvshare serve --config config/cpu.yaml` (streaming
/v1/completions, this script as the client on the same cores); share = 1 - offline / HTTP.

--clock wall (default) times everything by the wall clock: the figures for a quiet machine.
On a loaded one, `--threads 1 --clock cpu` times by CPU time instead (the step's own thread;
for HTTP the server process's CPU seconds against the offline process's), which other
processes inflate far less; bounds are then measured at one thread too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from http_share import http_share, load_client
from step_timers import BUCKETS, Timers, install_hooks

HERE = Path(__file__).resolve().parent
PROMPT_TOKENS = 240
PREFILL_TOKENS = 512
# The clock every figure uses: wall time, or with --clock cpu this thread's CPU time (with
# --threads 1 all the work runs on it), which a loaded machine's other processes inflate less.
_clock = time.perf_counter


# ---------------------------------------------------------------- the machine's bounds


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = _clock()
        fn()
        best = min(best, _clock() - started)
    return best


def read_bandwidth_gbs(torch, big=None) -> float:
    """GB/s of the best of 5 sums of `big` (default: 512 MiB of fp32, far past every cache)."""
    big = torch.ones(128 * 1024 * 1024) if big is None else big
    return big.numel() * big.element_size() / _best_seconds(big.sum) / 1e9


def measure_machine(torch) -> dict:
    """Read bandwidth (GB/s) and GEMM rates (GFLOP/s, fp32) at SmolLM2's gate/up shape."""
    import torch.nn.functional as F

    big = torch.ones(128 * 1024 * 1024)
    read_gbs = read_bandwidth_gbs(torch, big)
    target = torch.empty_like(big)
    copy_gbs = 2 * big.numel() * 4 / _best_seconds(lambda: target.copy_(big)) / 1e9
    weight = torch.randn(3072, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    rates = {}
    for rows in (1, 8, 32, 512):
        x = torch.randn(rows, 576)
        flops = 2 * rows * weight.numel()
        plain = flops / _best_seconds(lambda x=x: F.linear(x, weight), 20) / 1e9
        onednn = flops / _best_seconds(
            lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 20
        )
        rates[rows] = {"F.linear": plain, "oneDNN packed": onednn / 1e9}
    peak = max(max(r.values()) for r in rates.values())
    return {"read_gbs": read_gbs, "copy_gbs": copy_gbs, "gemm_gflops": rates, "peak_gflops": peak}


# Bytes a projection's weight takes per weight, by the class that holds it (BlockLinear: its
# blocks' own size); anything else holds its weight in the parameter's dtype.
_BYTES_PER_WEIGHT = {"Fp16Linear": 2, "Int8Linear": 1}


def _linear_bytes(module) -> int | None:
    """The bytes a linear layer reads per step (its weight as held), None for other modules."""
    blocks = getattr(module, "block_weight", None)
    if blocks is not None and hasattr(module, "out_features"):
        return blocks.data.numel()
    if type(module).__name__ == "BlockLinearParts":
        return None  # its parts (BlockLinear modules) count their own blocks
    if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        return None
    per_weight = _BYTES_PER_WEIGHT.get(type(module).__name__)
    if per_weight is None:
        weight = getattr(module, "weight", None)
        per_weight = 4 if weight is None else weight.element_size()
    return module.in_features * module.out_features * per_weight


def weight_bytes(model) -> dict:
    """The weight bytes one step reads as the model holds them: the layers' projections and
    the LM head (a tied head's copy or shared blocks: whatever compute_logits reads)."""
    layers = sum(b for m in model.model.layers.modules() if (b := _linear_bytes(m)) is not None)
    spec = model.spec
    head = model.lm_head
    head_bytes = _linear_bytes(head) if head is not None else None
    if head_bytes is None:  # a tied, unpacked head reads the fp32 table
        head_bytes = spec.vocab_size * spec.hidden_size * 4
    return {"layers": layers, "head": head_bytes}


def bounds_ms(spec, row: dict, machine: dict, weights: dict) -> dict:
    """Each bucket's floor in ms for one step: row["rows"] tokens through the layers (weights
    as held: `weights`, from weight_bytes(); activations fp32), row["kv_read"] KV positions read
    and row["pairs"] (query, key) pairs attended per layer, row["sampled"] rows through the LM
    head and the sampler. The native layer stack's floor is the three it runs together."""
    E, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    inter = spec.intermediate_size
    kv, q = spec.num_kv_heads * spec.head_dim, spec.num_heads * spec.head_dim
    rows, sampled = row["rows"], row["sampled"]
    bw, peak = machine["read_gbs"] * 1e9, machine["peak_gflops"] * 1e9

    def floor(num_bytes: float, flops: float = 0.0) -> float:
        return 1000 * max(num_bytes / bw, flops / peak)

    num_weights = L * (E * (q + 2 * kv) + q * E + E * 2 * inter + inter * E)
    activations = L * rows * ((E + q + 2 * kv) + (q + E) + (E + 2 * inter) + (inter + E))
    attention = L * (2 * row["kv_read"] * kv + rows * (2 * q + 2 * kv))
    # Two RMSNorms and two residual adds (read + write E each), rope on q and k, SiLU-and-mul.
    elementwise = L * rows * (8 * E + 2 * (q + kv) + 3 * inter) + rows * E
    bounds = {
        "projections": floor(weights["layers"] + 4 * activations, 2 * rows * num_weights),
        "attention": floor(4 * attention, L * 4 * q * row["pairs"]),
        "elementwise": floor(4 * elementwise),
        "LM head": floor(weights["head"], 2 * sampled * V * E) if sampled else 0.0,
        "sampling": floor(4 * sampled * V),
        "scheduling": 0.0,
    }
    bounds["native layers"] = sum(bounds[k] for k in ("projections", "attention", "elementwise"))
    return bounds


# ---------------------------------------------------------------- engine runs


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _timed_step(engine) -> float:
    started = _clock()
    engine.step()
    return _clock() - started


def _finish_all(engine, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def _add(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineRequest(request_id, prompt, params))


def profile_decode(engine, timers: Timers, batch: int, steps: int, rng) -> dict:
    """Decode-only steps at `batch` sequences: plain step times, then the same under timers."""
    ids = [f"decode-{batch}-{i}-{rng.randrange(10**9)}" for i in range(batch)]
    for request_id in ids:
        _add(engine, request_id, _prompt(rng, PROMPT_TOKENS), 4 * steps + 16)
    while not _is_decode_only(engine, batch):
        engine.step()
    plain = [_timed_step(engine) for _ in range(steps)]
    hooked, buckets = [], []
    for _ in range(steps):
        timers.reset()
        timers.enabled = True
        hooked.append(_timed_step(engine))
        timers.enabled = False
        buckets.append((dict(timers.seconds), timers.num_calls))
    _finish_all(engine, ids)
    context = batch * (PROMPT_TOKENS + 2 * steps)  # KV positions each layer reads, mid-run
    return _row(f"decode, batch {batch}", plain, hooked, buckets, batch, context, context, batch)


def _is_decode_only(engine, batch: int) -> bool:
    samples = engine.step_samples
    return bool(samples) and samples[-1].num_seqs == batch == samples[-1].num_tokens


def profile_prefill(engine, timers: Timers, repeats: int, rng) -> dict:
    """The first 512-token chunk of a fresh 600-token prompt (nothing cached), plain then timed."""
    plain, hooked, buckets = [], [], []
    for attempt in range(2 * repeats):
        request_id = f"prefill-{attempt}-{rng.randrange(10**9)}"
        _add(engine, request_id, _prompt(rng, PREFILL_TOKENS + 88), 1)
        is_timed = attempt >= repeats
        timers.reset()
        timers.enabled = is_timed
        seconds = _timed_step(engine)
        timers.enabled = False
        if is_timed:
            hooked.append(seconds)
            buckets.append((dict(timers.seconds), timers.num_calls))
        else:
            plain.append(seconds)
        _finish_all(engine, [request_id])
    pairs = PREFILL_TOKENS * (PREFILL_TOKENS + 1) // 2  # causal: token i sees i + 1 keys
    name = "prefill, 512-token chunk"
    return _row(name, plain, hooked, buckets, PREFILL_TOKENS, PREFILL_TOKENS, pairs, 0)


def _row(name, plain, hooked, buckets, rows, kv_read, pairs, sampled) -> dict:
    # The bucket split of the median timed step; per-call timer cost is set in main().
    middle = sorted(range(len(hooked)), key=lambda i: hooked[i])[len(hooked) // 2]
    seconds, num_calls = buckets[middle]
    return {
        "name": name,
        "rows": rows,
        "kv_read": kv_read,
        "pairs": pairs,
        "sampled": sampled,
        "step_ms": 1000 * statistics.median(plain),
        "timed_step_ms": 1000 * hooked[middle],
        "bucket_ms": {k: 1000 * v for k, v in seconds.items()},
        "timed_calls": num_calls,
    }


# ---------------------------------------------------------------- report


def format_tables(machine: dict, rows: list[dict], http: list[dict], cost_us: float) -> str:
    rates = ", ".join(
        f"{n} rows {r['F.linear']:.0f} / {r['oneDNN packed']:.0f}"
        for n, r in machine["gemm_gflops"].items()
    )
    lines = [
        f"Machine: read {machine['read_gbs']:.1f} GB/s, copy {machine['copy_gbs']:.1f} GB/s; "
        f"fp32 GFLOP/s (576 x 3072, F.linear / oneDNN packed): {rates}; "
        f"timer cost {cost_us:.2f} us per timed call.",
        "",
        "| step | total ms (timed) | weight MB read | weights GB/s (of read bw) | "
        + " | ".join(f"{b} ms (bound)" for b in BUCKETS) + " | Python/glue ms |",
        "|---|---|---|---|" + "---|" * (len(BUCKETS) + 1),
    ]  # fmt: skip
    for row in rows:
        cells = [f"{row['bucket_ms'][b]:.2f} ({row['bounds_ms'][b]:.2f})" for b in BUCKETS]
        fraction = row["weight_gbs"] / machine["read_gbs"]
        lines.append(
            f"| {row['name']} | {row['step_ms']:.1f} ({row['timed_step_ms']:.1f}) | "
            f"{row['weight_mb']:.1f} | {row['weight_gbs']:.1f} ({100 * fraction:.0f}%) | "
            + " | ".join(cells) + f" | {row['python_ms']:.2f} |"
        )  # fmt: skip
    if http:
        lines += ["", "| batch | offline s | HTTP s | offline tok/s | HTTP tok/s | HTTP share |"]
        lines.append("|---|---|---|---|---|---|")
        for h in http:
            lines.append(
                f"| {h['batch']} | {h['offline_s']:.2f} | {h['http_s']:.2f} | "
                f"{h['offline_tok_s']:.1f} | {h['http_tok_s']:.1f} | {100 * h['share']:.1f}% |"
            )
    return "\n".join(lines)


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE.parent, help="source tree to profile")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--http-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: cpu.yaml)"
    )
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--model", default=None, help="default: cpu.yaml's (SmolLM2)")
    parser.add_argument("--quantization", default=None, help="default: cpu.yaml's")
    parser.add_argument(
        "--native-decode", choices=("on", "off"), default=None, help="default: cpu.yaml's"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (one thread's CPU time is the whole step)")
    return args


def main(argv: list[str] | None = None) -> int:
    global _clock
    args = _parse_args(argv)
    client = load_client()  # before sys.path leads to `repo`
    if args.clock == "cpu":
        _clock = time.thread_time
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # idle OpenMP threads must not spin
    if args.threads is not None:
        os.environ["KVSHARE_NUM_THREADS"] = str(args.threads)  # the HTTP server's too
    repo = args.repo.resolve()
    out = None if args.out is None else args.out.resolve()  # relative to where it was started
    sys.path.insert(0, str(repo))
    os.chdir(repo)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # before measure_machine: bounds at the same threads
    from app.settings import load_settings
    from engine.llm_engine import LLMEngine
    from engine.runtime.models.llama import LlamaSpec

    machine = measure_machine(torch)
    config = load_settings(repo / "config" / "cpu.yaml", environ={}).to_engine_config()
    # The prefill row times one PREFILL_TOKENS chunk, whatever step budget cpu.yaml serves with.
    budget = max(config.max_num_batched_tokens, PREFILL_TOKENS)
    config = dataclasses.replace(config, audit_sample_rate=0.0, max_num_batched_tokens=budget)
    if hasattr(config, "speculative_ngram_tokens"):  # a tree that has the setting
        # No drafts: every decode row is a sequence's next token, so a step's bytes and time
        # are those of plain decoding at that batch size (cpu.yaml drafts for a lone stream).
        config = dataclasses.replace(config, speculative_ngram_tokens=0)
    if args.threads is not None:
        config = dataclasses.replace(config, num_threads=args.threads)
    if args.quantization is not None:
        config = dataclasses.replace(config, quantization=args.quantization)
    if args.model is not None:
        config = dataclasses.replace(config, model=args.model)
    if args.native_decode is not None:  # a tree that has the setting
        config = dataclasses.replace(config, native_decode=args.native_decode == "on")
    engine = LLMEngine(config)
    spec = LlamaSpec.from_hf_config(engine.runner.hf_config)
    timers = Timers(_clock)
    wrapped = install_hooks(timers, engine)
    cost = timers.cost_per_call()
    rng = random.Random(0)
    profile_decode(engine, timers, 2, 2, rng)  # warm-up: allocator, kernel library, caches
    rows = [profile_decode(engine, timers, b, args.steps, rng) for b in args.batches]
    rows.append(profile_prefill(engine, timers, args.prefill_repeats, rng))
    weights = weight_bytes(engine.runner.model)
    for row in rows:
        row["bounds_ms"] = bounds_ms(spec, row, machine, weights)
        row["weight_mb"] = (weights["layers"] + (weights["head"] if row["sampled"] else 0)) / 1e6
        row["weight_gbs"] = row["weight_mb"] / row["step_ms"]  # MB per ms = GB/s
        timed = sum(row["bucket_ms"].values()) + 1000 * cost * row["timed_calls"]
        row["python_ms"] = max(0.0, row["timed_step_ms"] - timed)
    print(f"clock: {args.clock}, {torch.get_num_threads()} threads", flush=True)
    print(format_tables(machine, rows, [], 1e6 * cost), flush=True)
    http = []
    if args.http_batches:
        batch_prompts = {
            b: [_prompt(rng, PROMPT_TOKENS) for _ in range(b)] for b in args.http_batches
        }
        http = http_share(engine, client, repo, batch_prompts, _prompt(rng, 32), _clock)
        print(format_tables(machine, [], http, 1e6 * cost).split("\n", 2)[2])
    if out is not None:
        report = {"repo": str(repo), "machine": machine, "rows": rows, "http": http,
                  "timer_cost_us": 1e6 * cost, "wrapped": wrapped,
                  "threads": torch.get_num_threads(), "clock": args.clock}  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
