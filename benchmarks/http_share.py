"""The HTTP front end's share of the step profile (benchmarks/profile_step.py): the same
token-id prompts (64 output tokens, ignore_eos) run offline and over a real `kvshare serve
--config config/cpu.yaml` (streaming /v1/completions, this process as the client on the same
cores); share = 1 - offline / HTTP.

The clock is the profile's: the wall clock, or with --clock cpu (time.thread_time) the
offline process's CPU seconds against the server process's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
Clock = Callable[[], float]


def load_client() -> tuple[ModuleType, ModuleType]:
    """This tree's serving client and server helpers (benchmarks/serving.py, servers.py)."""
    return _load("serving"), _load("servers")


def _load(name: str) -> ModuleType:
    # By path: with --repo an older tree, `benchmarks` on sys.path is that tree's package.
    spec = importlib.util.spec_from_file_location(f"kvshare_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def start_kvshare(servers: ModuleType, repo: Path):
    """`kvshare serve --config config/cpu.yaml` from `repo` on a free port: (process, URL)."""
    port = servers.free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    base_url = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": str(repo)}  # OMP_WAIT_POLICY and KVSHARE_NUM_THREADS are inherited
    return servers.start_server(command, f"{base_url}/ready", cwd=repo, env=env), base_url


def _process_clock(clock: Clock) -> Clock:
    # CPU mode: the whole process (the engine's own threads), as the server is measured.
    return time.process_time if clock is time.thread_time else clock


async def _http_batch(serving, base_url: str, prompts, max_tokens: int, clock: Clock) -> float:
    import httpx

    model = None
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        model = await serving.discover_model(client, f"{base_url}/v1")
        bodies = [
            {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            for p in prompts
        ]  # fmt: skip
        url = f"{base_url}/v1/completions"
        started = clock()
        results = await asyncio.gather(
            *(serving.stream_chat(client, url, b, serving.RequestResult(i, 0)) for i, b in
              enumerate(bodies))
        )  # fmt: skip
        elapsed = clock() - started
    bad = [r.error for r in results if not r.ok or r.output_tokens != max_tokens]
    if bad:
        raise RuntimeError(f"HTTP requests failed: {bad[:2]}")
    return elapsed


def http_share(
    engine,
    client: tuple[ModuleType, ModuleType],
    repo: Path,
    batch_prompts: dict[int, list[list[int]]],
    warm_up_prompt: list[int],
    clock: Clock,
    max_tokens: int = 64,
) -> list[dict]:
    """Offline vs HTTP time of the same batch of requests, per batch size; client: what
    load_client() returns."""
    from engine.core.sampling_params import SamplingParams

    serving, servers = client
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    process_clock = _process_clock(clock)
    offline = {}
    for batch, prompts in batch_prompts.items():
        started = process_clock()
        engine.generate(prompts, params)
        offline[batch] = process_clock() - started
    process, base_url = start_kvshare(servers, repo)
    rows = []
    try:
        asyncio.run(_http_batch(serving, base_url, [warm_up_prompt], 4, clock))
        for batch, prompts in batch_prompts.items():
            cpu_before = servers.proc_cpu_seconds(Path(f"/proc/{process.pid}/stat"))
            http = asyncio.run(_http_batch(serving, base_url, prompts, max_tokens, clock))
            if clock is time.thread_time:  # the server's CPU seconds, not the wall time
                http = servers.proc_cpu_seconds(Path(f"/proc/{process.pid}/stat")) - cpu_before
            rows.append({
                "batch": batch, "offline_s": offline[batch], "http_s": http,
                "offline_tok_s": batch * max_tokens / offline[batch],
                "http_tok_s": batch * max_tokens / http, "share": 1 - offline[batch] / http,
            })  # fmt: skip
    finally:
        servers.stop_server(process)
    return rows
