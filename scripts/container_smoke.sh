#!/usr/bin/env bash
# Run the kvshare CPU image as a user would and check what they hit; print a table, exit 1 on a
# FAIL. (The CUDA image has no prebuilt CPU kernels and another size: this script is not for it.)
# Usage: scripts/container_smoke.sh IMAGE [NETWORK]
#   NETWORK: host (default; works where Docker has no bridge network) or bridge (ports
#   published on 127.0.0.1). Needs docker, curl and python3 on the host.
# Two runs of the image's own command (first start, HEALTHCHECK, the embedded default model):
#   1. default port, default grace: /ready, chat, streamed chat, /metrics, the prebuilt native
#      kernels loaded, uid, `healthy`, the pinned versions, then `docker stop` during a stream
#      that finishes within the grace;
#   2. `kvshare serve --port 18190` (the health check must follow it) with a 3 s grace and a
#      stream that outlives it: the stream must end with an error event and [DONE].
# Both stops must exit 0 within --stop-timeout, never cut a stream. Last, the image size against
# SIZE_GOAL_BYTES (default 1.6 GB, the CPU image's goal).
set -uo pipefail

IMAGE=${1:?usage: $0 IMAGE [host|bridge]}
NETWORK=${2:-host}
GRACE_S=30                          # shutdown_grace_seconds in config/cpu.yaml
STOP_TIMEOUT_S=$((GRACE_S + 15))    # what deploy/README.md tells `docker run --stop-timeout`
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/kvshare-smoke.XXXXXX)
ROWS=()
FAILED=0
CONTAINER=""

cleanup() {
    [ -n "$CONTAINER" ] && docker rm -f "$CONTAINER" >/dev/null 2>&1
    rm -rf "$WORK"
}
trap cleanup EXIT

row() {  # row CHECK RESULT DETAIL
    ROWS+=("$1|$2|$3")
    [ "$2" = PASS ] || FAILED=1
    printf '%-34s %-5s %s\n' "$1" "$2" "$3" >&2
}

check() {  # check CHECK DETAIL COMMAND...: PASS when COMMAND succeeds
    local name=$1 detail=$2
    shift 2
    if "$@"; then row "$name" PASS "$detail"; else row "$name" FAIL "$detail"; fi
}

# start PORT [ARGS...]: run the image detached; ARGS replace its command when given.
start() {
    local port=$1
    shift
    local publish=()
    [ "$NETWORK" = host ] || publish=(-p "127.0.0.1:$port:$port")
    CONTAINER=$(docker run -d --network "$NETWORK" "${publish[@]}" \
        --stop-timeout "$STOP_TIMEOUT_S" "${EXTRA_RUN_ARGS[@]}" "$IMAGE" "$@")
    URL="http://127.0.0.1:$port"
}

wait_for() {  # wait_for SECONDS COMMAND...: poll once a second
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ $SECONDS -ge $deadline ] && return 1
        sleep 1
    done
}

is_ready() { curl -fsS -o /dev/null "$URL/ready"; }
health() { docker inspect --format '{{.State.Health.Status}}' "$CONTAINER" 2>/dev/null; }
is_healthy() { [ "$(health)" = healthy ]; }

chat() {  # chat BODY_JSON OUT_FILE [curl args]
    curl -sS -N --max-time 600 "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "$1" -o "$2" "${@:3}"
}

body() {  # body MAX_TOKENS STREAM [EXTRA_JSON]
    printf '{"model": "%s", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": %s, "stream": %s, "temperature": 0%s}' "$MODEL" "$1" "$2" "${3:-}"
}

# stream_end FILE: "finish_reason=X" or "error=CODE" of the last event before [DONE], or "cut".
stream_end() {
    python3 - "$1" <<'EOF'
import json, sys
events = [line[6:] for line in open(sys.argv[1], encoding="utf-8").read().splitlines()
          if line.startswith("data: ")]
if not events or events[-1] != "[DONE]" or len(events) < 2:
    print("cut")
    sys.exit()
last = json.loads(events[-2])
if "error" in last:
    print(f"error={last['error'].get('code')}")
else:
    reasons = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e).get("choices", [])]
    print(f"finish_reason={[r for r in reasons if r][-1] if any(reasons) else None}")
EOF
}

# stop_during_stream MAX_TOKENS EXTRA_JSON EXPECTED_END: docker stop while a stream runs.
stop_during_stream() {
    local out="$WORK/stop-stream.txt"
    chat "$(body "$1" true "$2")" "$out" &
    local client=$!
    wait_for 60 grep -q '"content": "[^"]' "$out"  # tokens are flowing
    local started=$SECONDS
    docker stop "$CONTAINER" >/dev/null
    local stop_s=$((SECONDS - started))
    wait "$client"
    local end code
    end=$(stream_end "$out")
    code=$(docker inspect --format '{{.State.ExitCode}}' "$CONTAINER")
    check "stop during a stream: its end" "$end" [ "$end" = "$3" ]
    check "stop: exit code, time" "exit $code after ${stop_s}s (limit ${STOP_TIMEOUT_S}s)" \
        [ "$code" = 0 ]
}

EXTRA_RUN_ARGS=()
MODEL=""

# ---- run 1: the image's default command
t0=$SECONDS
start 8000
if wait_for 300 is_ready; then
    row "/ready" PASS "after $((SECONDS - t0))s"
else
    row "/ready" FAIL "not ready after 300s"
    docker logs "$CONTAINER" 2>&1 | tail -20 >&2
fi
MODEL=$(curl -fsS "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

chat "$(body 16 false)" "$WORK/chat.json"
check "chat completion" "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["usage"]["completion_tokens"], "tokens:", repr(d["choices"][0]["message"]["content"][:40]))' "$WORK/chat.json" 2>&1)" \
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["choices"][0]["message"]["content"]' "$WORK/chat.json"

chat "$(body 16 true)" "$WORK/stream.txt"
end=$(stream_end "$WORK/stream.txt")
check "streamed chat completion" "$end, then [DONE]" [ "${end%%=*}" = finish_reason ]

curl -fsS "$URL/metrics" -o "$WORK/metrics.txt"
generated=$(awk '/^kvshare_generation_tokens_total /{print $2}' "$WORK/metrics.txt")
check "/metrics" "kvshare_generation_tokens_total ${generated:-missing}" \
    python3 -c "import sys; sys.exit(not float('${generated:-0}') >= 32)"

# No compiler in the image: the native kernels must come prebuilt, not fall back to torch.
kernels=$(docker logs "$CONTAINER" 2>&1 | grep -o 'prebuilt native CPU kernels [^ ]*' | head -1)
check "native kernels, prebuilt" "${kernels:-none loaded}" \
    sh -c "[ -n '$kernels' ] && ! docker logs '$CONTAINER' 2>&1 | grep -q 'using the torch attention'"

uid=$(docker exec "$CONTAINER" id -u)
check "runs as uid 10001" "uid $uid" [ "$uid" = 10001 ]

t0=$SECONDS
wait_for 120 is_healthy
check "health check: healthy" "$(health) after $((SECONDS - t0))s more" is_healthy

# The image's packages are the lock's versions (local labels such as +cpu aside).
docker exec "$CONTAINER" pip list --format=freeze 2>/dev/null >"$WORK/freeze.txt"
mismatches=$(python3 - "$WORK/freeze.txt" "$HERE/requirements/constraints.txt" <<'EOF'
import re, sys
def pins(path):
    out = {}
    for line in open(path, encoding="utf-8"):
        if "==" in line and not line.startswith("#"):
            name, version = line.strip().split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+")[0]
    return out
image, lock = pins(sys.argv[1]), pins(sys.argv[2])
for name in ("kvshare", "pip"):  # the project itself; the venv's own installer
    image.pop(name, None)
print(len(image), ",".join(f"{n}=={v}" for n, v in image.items() if lock.get(n) != v) or "none")
EOF
)
check "packages pinned by the lock" "${mismatches% *} packages, off the lock: ${mismatches#* }" \
    [ "${mismatches#* }" = none ]
check "no triton, no dev tools" "$(grep -ciE '^(triton|pytest|ruff|hypothesis|openai)==' "$WORK/freeze.txt") found" \
    sh -c "! grep -qiE '^(triton|pytest|ruff|hypothesis|openai)==' '$WORK/freeze.txt'"

stop_during_stream 24 ', "ignore_eos": true' "finish_reason=length"  # a few seconds here
docker rm "$CONTAINER" >/dev/null

# ---- run 2: another port given as a flag, a stream longer than a short grace
EXTRA_RUN_ARGS=(-e KVSHARE_SHUTDOWN_GRACE_SECONDS=3)
start 18190 kvshare serve --config config/cpu.yaml --host 0.0.0.0 --port 18190
wait_for 300 is_ready
t0=$SECONDS
wait_for 120 is_healthy
check "health check follows --port 18190" "$(health) after $((SECONDS - t0))s" is_healthy
stop_during_stream 4000 ', "ignore_eos": true' "error=draining"
docker rm "$CONTAINER" >/dev/null
CONTAINER=""

size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
SIZE_GOAL_BYTES=${SIZE_GOAL_BYTES:-1600000000}  # the CPU image's goal
check "image size" "$(python3 -c "print(f'{$size / 1e9:.3f} GB ({$size / 2**30:.2f} GiB), goal < {$SIZE_GOAL_BYTES / 1e9:.2f} GB')")" \
    [ "$size" -lt "$SIZE_GOAL_BYTES" ]

echo
echo "| check | result | detail |"
echo "| --- | --- | --- |"
for r in "${ROWS[@]}"; do
    IFS='|' read -r name result detail <<<"$r"
    echo "| $name | $result | $detail |"
done
exit $FAILED
