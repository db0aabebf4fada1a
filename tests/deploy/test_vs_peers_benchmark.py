"""benchmarks/vs_llama_server.py's own arithmetic and the peers' command lines: options, round
order, medians, ratios and the table. The benchmark itself (real llama-server and vLLM) runs by
hand, never in `make test`; nothing here needs either installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import peer_servers, vs_llama_server
from benchmarks.peer_servers import Peers, server_command
from benchmarks.vs_llama_server import _parse_args, format_table, medians, ratio, round_order


def test_default_quantization_is_what_make_serve_runs():
    config = yaml.safe_load((peer_servers.REPO / "config" / "cpu.yaml").read_text())
    args = _parse_args([])
    assert args.variants == {"kvshare": ["--quantization", config["engine"]["quantization"]]}
    assert args.peers == ["llama-server", "vllm", "vllm-tuned"]
    assert (args.rounds, args.num_requests, args.num_requests_c1, args.max_tokens) == (
        2,
        32,
        16,
        64,
    )


def test_quantization_flag_variants_and_quick():
    argv = ["--quantization", "native", "--kvshare-variant", "exact=--quantization none"]
    args = _parse_args([*argv, "--quick", "--peers", "llama-server"])
    assert args.variants == {"kvshare": ["--quantization", "native"],
                             "exact": ["--quantization", "none"]}  # fmt: skip
    assert (args.rounds, args.num_requests, args.num_requests_c1, args.max_tokens) == (1, 4, 4, 16)
    assert args.peers == ["llama-server"]


@pytest.mark.parametrize(
    "argv",
    [["--kvshare-variant", "kvshare=--quantization none"], ["--kvshare-variant", "vllm="],
     ["--kvshare-variant", "=x"], ["--rounds", "0"], ["--peers", "tgi"]],
)  # fmt: skip
def test_bad_options_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(argv)
    assert exit_info.value.code == 2


def test_vllm_python_from_flag_else_environment(monkeypatch):
    monkeypatch.setenv("VLLM_PYTHON", "/venv/bin/python")
    assert _parse_args([]).vllm_python == Path("/venv/bin/python")
    assert _parse_args(["--vllm-python", "/v2/python"]).vllm_python == Path("/v2/python")
    monkeypatch.delenv("VLLM_PYTHON")
    assert _parse_args([]).vllm_python is None


def test_without_vllm_python_vllm_is_left_out(monkeypatch):
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    args = _parse_args(["--peers", "vllm", "vllm-tuned"])
    peers = vs_llama_server.resolve_peers(args)
    assert args.peers == [] and peers.vllm_python is None


def test_missing_llama_server_with_no_build_returns_none(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("KVSHARE_CACHE_DIR", str(tmp_path))
    assert (
        vs_llama_server.resolve_peers(_parse_args(["--no-build", "--peers", "llama-server"]))
        is None
    )


def test_round_order_alternates():
    servers = ["kvshare", "llama-server", "vllm"]
    assert round_order(servers, 0) == servers
    assert round_order(servers, 1) == ["vllm", "llama-server", "kvshare"]
    assert round_order(servers, 2) == servers


PEERS = Peers(
    llama_server=Path("/b/llama-server"), gguf=Path("/m/x.gguf"), vllm_python=Path("/v/python"),
    vllm_model=Path("/m/dir"), kvshare_variants={"kvshare": ["--quantization", "fp16"]},
)  # fmt: skip


def test_llama_server_runs_eight_slots_two_threads_on_the_gguf():
    command, ready, env = server_command("llama-server", PEERS, 9000)
    assert command[:3] == ["/b/llama-server", "-m", "/m/x.gguf"]
    assert command[command.index("-np") + 1] == "8" and command[command.index("-t") + 1] == "2"
    assert command[command.index("-c") + 1] == str(8 * 2048)
    assert ready == "http://127.0.0.1:9000/health" and env == {}


def test_vllm_as_a_user_starts_it_and_tuned():
    command, ready, env = server_command("vllm", PEERS, 9001)
    assert command[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == "/m/dir"
    assert command[command.index("--dtype") + 1] == "float32"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert (ready, env) == ("http://127.0.0.1:9001/health", {})
    tuned, _, tuned_env = server_command("vllm-tuned", PEERS, 9001)
    assert tuned == command and tuned_env == peer_servers.VLLM_CPU_TUNING
    assert tuned_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_kvshare_runs_the_serve_config_with_its_flags():
    command, ready, env = server_command("kvshare", PEERS, 9002)
    assert command[command.index("--config") + 1] == str(peer_servers.SERVE_CONFIG)
    assert command[-2:] == ["--quantization", "fp16"]
    assert ready == "http://127.0.0.1:9002/ready" and env == {}
    with pytest.raises(ValueError):
        server_command("tgi", PEERS, 9002)


def test_a_kvshare_variants_upper_case_settings_are_its_environment():
    peers = Peers(kvshare_variants={"fmas": ["KVSHARE_CPU_AMX=0", "--max-num-seqs", "8"]})
    command, _, env = server_command("fmas", peers, 9003)
    assert env == {"KVSHARE_CPU_AMX": "0"}
    assert command[-2:] == ["--max-num-seqs", "8"] and "KVSHARE_CPU_AMX=0" not in command


def _run(server, workload, concurrency, tok_s, ttft_s, tpot_s, failed=0):
    summary = {"output_token_throughput": tok_s, "failed": failed, "unfinished": 0,
               "ttft_s": {"p50": ttft_s},
               "tpot_s": {"p50": tpot_s} if tpot_s else None}  # fmt: skip
    return {"server": server, "workload": workload, "concurrency": concurrency,
            "summary": summary}  # fmt: skip


def test_medians_over_rounds_and_ratios():
    results = [
        _run("kvshare", "unique", 1, 30.0, 0.080, 0.030),
        _run("kvshare", "unique", 1, 34.0, 0.090, 0.020),
        _run("kvshare", "unique", 1, 50.0, 0.100, 0.040, failed=1),
        _run("llama-server", "unique", 1, 60.0, 0.110, None),
    ]
    table = medians(results)
    ours = table[("unique", 1, "kvshare")]
    assert ours["tok_s"] == 34.0 and ours["ttft_ms"] == pytest.approx(90.0)
    assert ours["tpot_ms"] == pytest.approx(30.0)
    assert (ours["failed"], ours["rounds"]) == (1, 3)
    assert table[("unique", 1, "llama-server")]["tpot_ms"] is None
    assert ratio(34.0, 68.0) == 0.5
    assert ratio(None, 68.0) is None and ratio(34.0, 0.0) is None


def test_table_has_every_server_and_ratio_per_peer():
    results = [
        _run("kvshare", "unique", 1, 30.0, 0.080, 0.032),
        _run("llama-server", "unique", 1, 60.0, 0.110, 0.015),
        _run("vllm", "unique", 1, 15.0, 0.262, 0.060),
        _run("kvshare", "unique", 8, 80.0, 1.392, 0.090),
        _run("llama-server", "unique", 8, 32.0, 9.982, 0.200),
    ]
    plan = {"workloads": ["unique"], "concurrencies": [1, 8], "rounds": 1,
            "variants": {"kvshare": ["--quantization", "fp16"]},
            "servers": ["kvshare", "llama-server", "vllm"]}  # fmt: skip
    lines = format_table(medians(results), plan).splitlines()
    assert "kvshare / llama-server" in lines[2] and "kvshare / vllm" in lines[2]
    assert lines[4] == ("| unique | 1 | 30.0 | 60.0 | 15.0 | 0.50x | 2.00x | 80 / 110 / 262 | "
                        "32.0 / 15.0 / 60.0 | - |")  # fmt: skip
    assert lines[5] == "| unique | 8 | 80.0 | 32.0 | - | 2.50x | - | 1392 / 9982 / - | - | - |"
    assert lines[-1] == "1 rounds, medians; failed or unfinished requests: 0"
