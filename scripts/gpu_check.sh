#!/usr/bin/env bash
# The GPU check, for the GPU test machine as it is: its own python3 (torch, triton,
# transformers), no package registry, at most 64 MiB of files from here and 8 back.
#
# The packages its image lacks travel as wheels (`make gpu-wheels` fetches them, cp312
# manylinux, into .gpu-wheels/ with SmolLM2's tokenizer files); they are installed into a
# temporary folder with --no-index --no-deps --target, ahead on PYTHONPATH. Models are built in
# code with random weights. Stages run in order, each under its own time cap, each adding one
# line to the summary (scripts/gpu_check.py): setup, (a) kernels, (b) engine, (c) serve,
# (d) throughput. About 6 minutes in all on the GPU.
#
# Usage: scripts/gpu_check.sh            on the GPU (results in $OUT, default ./gpu_out)
#        scripts/gpu_check.sh --local    the same stages on the CPU: Triton's interpreter,
#                                        a tiny model (make test runs it)
# Environment: PYTHON (default: python3; --local: .venv/bin/python where it exists),
#              KVSHARE_GPU_WHEELS (default .gpu-wheels), KVSHARE_GPU_CHECK_BUDGET_S.
# Files under $OUT (at most 8): summary.md (also printed last), summary.json, stages.jsonl,
# check.log, serve.log, stage_rcs.txt.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO="$(pwd)"
LOCAL_FLAG=""
if [[ "${1:-}" == "--local" ]]; then
    LOCAL_FLAG="--local"
elif [[ -n "${1:-}" ]]; then
    echo "usage: $0 [--local]" >&2
    exit 2
fi
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/{summary.md,summary.json,stages.jsonl,check.log,serve.log,stage_rcs.txt}
WHEELS="${KVSHARE_GPU_WHEELS:-$REPO/.gpu-wheels}"
STARTED=$(date +%s)

if [[ -n "$LOCAL_FLAG" ]]; then
    default_python=python3
    [[ -x "$REPO/.venv/bin/python" ]] && default_python="$REPO/.venv/bin/python"
    PYTHON="${PYTHON:-$default_python}"
    export TRITON_INTERPRET=1 # Triton kernels on the CPU
    BUDGET_S="${KVSHARE_GPU_CHECK_BUDGET_S:-900}"
    CAPS=(setup:60 kernels:240 engine:300 serve:180 throughput:180)
else
    PYTHON="${PYTHON:-python3}"
    unset TRITON_INTERPRET # compiled kernels only
    BUDGET_S="${KVSHARE_GPU_CHECK_BUDGET_S:-345}"
    CAPS=(setup:25 kernels:70 engine:90 serve:60 throughput:100)
fi
export TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# xgrammar's tvm_ffi would otherwise build a torch extension at import where torch lacks the
# DLPack exchange API: seconds of a time-capped run for nothing the check uses
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export KVSHARE_GPU_WHEELS="$WHEELS"

say() { echo "[gpu_check $(($(date +%s) - STARTED))s] $*" | tee -a "$OUT/check.log"; }
cap() { # cap SECONDS: the smaller of SECONDS and what is left of the budget (at least 5)
    local left=$((BUDGET_S - ($(date +%s) - STARTED)))
    ((left < $1)) && echo $((left > 5 ? left : 5)) || echo "$1"
}

# ---- the wheels: those that fit this interpreter, into a temporary folder ------------------
SITE="$(mktemp -d "${TMPDIR:-/tmp}/kvshare-gpu-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
fitting_wheels() { # one path per line; the ones that do not fit go to the log
    "$PYTHON" - "$WHEELS" <<'EOF'
import sys
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

supported = set(sys_tags())
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, _, _, tags = parse_wheel_filename(wheel.name)
    if supported & set(tags):
        print(wheel)
    else:
        print(f"wheel {wheel.name} does not fit this interpreter: skipped", file=sys.stderr)
EOF
}
INSTALLED=""
if [[ -d "$WHEELS" ]]; then
    mapfile -t wheels < <(fitting_wheels 2>>"$OUT/check.log")
    if ((${#wheels[@]})); then
        if timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --disable-pip-version-check --target "$SITE" "${wheels[@]}" \
            >>"$OUT/check.log" 2>&1; then
            INSTALLED="$(for w in "${wheels[@]}"; do basename "$w" | cut -d- -f1; done | paste -sd,)"
            say "installed ${#wheels[@]} wheels from $WHEELS into $SITE"
        else
            say "pip could not install the wheels (check.log); going on without them"
        fi
    fi
else
    say "no wheel folder at $WHEELS (make gpu-wheels): the modules must be installed already"
fi
export KVSHARE_GPU_SITE="$SITE" KVSHARE_GPU_WHEELS_INSTALLED="$INSTALLED"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---- the stages, in order, each under its own cap ------------------------------------------
SPARE=0 # seconds earlier stages left unused, passed on to the next
for entry in "${CAPS[@]}"; do
    stage="${entry%%:*}"
    seconds="$(cap $((${entry##*:} + SPARE)))"
    stage_started=$(date +%s)
    say "stage $stage (cap ${seconds}s)"
    # shellcheck disable=SC2086  # LOCAL_FLAG is empty or one word
    timeout -k 10 "$seconds" "$PYTHON" scripts/gpu_check.py --stage "$stage" --out "$OUT" \
        --seconds "$seconds" $LOCAL_FLAG >>"$OUT/check.log" 2>&1
    rc=$?
    echo "$stage $rc" >>"$OUT/stage_rcs.txt"
    SPARE=$((seconds - ($(date +%s) - stage_started)))
    ((SPARE < 0)) && SPARE=0
    say "stage $stage rc=$rc"
done

# shellcheck disable=SC2086
"$PYTHON" scripts/gpu_check.py --stage report --out "$OUT" --started-at "$STARTED" $LOCAL_FLAG
