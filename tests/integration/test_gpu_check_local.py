"""scripts/gpu_check.sh --local: the GPU check's stages on the CPU (Triton's interpreter, a tiny
random model), through the same wheel-install path the GPU machine takes.

The wheel folder here holds a probe wheel that fits this interpreter and one that fits none, so
the install step is shown to take the one, skip the other, and put the temporary folder first on
the path. The summary the script writes is checked stage by stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ["setup", "kernels", "engine", "serve", "throughput"]


def write_wheel(folder: Path, name: str, tag: str) -> Path:
    """A minimal wheel of one module `name` that says so when imported."""
    dist_info = f"{name}-1.0.dist-info"
    path = folder / f"{name}-1.0-{tag}.whl"
    python, abi, platform = tag.split("-")
    files = {
        f"{name}/__init__.py": f"WHO = {name!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            f"Tag: {python}-{abi}-{platform}\n"
        ),
    }
    record = "".join(f"{file},,\n" for file in files) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
        archive.writestr(f"{dist_info}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def local_check(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    wheels = tmp_path_factory.mktemp("wheels")
    write_wheel(wheels, "kvshare_probe", "py3-none-any")
    write_wheel(wheels, "kvshare_elsewhere", "cp39-cp39-win_amd64")
    out = tmp_path_factory.mktemp("out")
    env = {**os.environ, "OUT": str(out), "KVSHARE_GPU_WHEELS": str(wheels),
           "PYTHON": sys.executable}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)  # the script sets it for --local
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--local"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return result, out


def test_every_stage_passes_and_the_table_is_printed_last(local_check) -> None:
    result, out = local_check
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "local" and summary["ok"]
    assert [stage["stage"] for stage in summary["stages"]] == STAGES
    for stage in summary["stages"]:
        assert stage["ok"], stage
        assert stage["line"] and isinstance(stage["seconds"], float)
    table = (out / "summary.md").read_text()
    assert result.stdout.rstrip().endswith(table.rstrip())
    for stage in STAGES:
        assert f"| {stage} | ok |" in table
    # the device machine sends back at most 8 files
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


def test_the_wheels_that_fit_are_installed_into_the_temporary_folder(local_check) -> None:
    _, out = local_check
    setup = json.loads((out / "summary.json").read_text())["stages"][0]["details"]
    assert setup["installed_wheels"] == ["kvshare_probe"]
    assert "kvshare_probe" in setup["site_modules"]
    assert "kvshare_elsewhere" not in setup["site_modules"]
    log = (out / "check.log").read_text()
    assert "kvshare_elsewhere-1.0-cp39-cp39-win_amd64.whl does not fit" in log
    assert setup["missing"] == []


def test_the_stages_check_what_they_say(local_check) -> None:
    _, out = local_check
    stages = {s["stage"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    kernels = stages["kernels"]["details"]["checks"]
    names = " ".join(check["name"] for check in kernels)
    for kernel in ("attention float32", "attention bfloat16", "store_kv", "copy_blocks",
                   "rms_norm bfloat16", "add_rms_norm", "silu_mul", "gelu_tanh_mul",
                   "rope_store bfloat16"):  # fmt: skip
        assert kernel in names
    assert all(check["ok"] for check in kernels)
    engine = stages["engine"]["details"]
    assert engine["fp32_equals_hf"]["equal_prompts"] == 2
    assert engine["bf16_agrees_with_hf"]["agreement"] >= 0.99
    assert engine["graphs_equal_eager"].get("skipped")  # no CUDA here
    assert engine["async_equals_sync"]["ok"] and engine["async_equals_sync"]["lookahead_steps"]
    assert engine["host_syncs_per_decode_step"].get("skipped")
    serve = stages["serve"]["details"]
    assert set(serve) == {"chat", "stream", "n=2", "logprobs", "json_schema", "leaked=0"}
    shapes = stages["throughput"]["details"]["shapes"]
    assert set(shapes["tiny"]["decode"]) == {"1", "3"}
    assert shapes["tiny"]["prefill_tokens_per_s"] > 0 and not shapes["tiny"]["errors"]
    for entry in shapes["tiny"]["decode"].values():
        assert entry["decode_tokens_per_s"] > 0 and entry["bound_tokens_per_s"] > 0


def test_a_stage_past_its_cap_reports_what_ran(tmp_path) -> None:
    """With almost no time, the kernels stage starts one group of checks, reports it, and
    fails naming the groups it did not run (a killed stage would report nothing)."""
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--stage", "kernels", "--out", str(tmp_path),
         "--local", "--seconds", "0.001"],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "stages.jsonl").read_text())
    assert not record["ok"] and "groups not run (time cap)" in record["line"]


def test_a_stage_that_left_no_record_is_reported_failed(tmp_path) -> None:
    record = {"stage": "setup", "ok": True, "seconds": 1.0, "line": "fine", "details": {}}
    (tmp_path / "stages.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "stage_rcs.txt").write_text("setup 0\nkernels 124\n")
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--stage", "report", "--out", str(tmp_path),
         "--local"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert stages[0]["ok"] and not any(s["ok"] for s in stages[1:])
    assert "rc 124" in stages[1]["line"]
    assert "| kernels | FAIL |" in result.stdout
