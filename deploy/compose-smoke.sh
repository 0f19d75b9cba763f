#!/usr/bin/env bash
# Smoke test of deploy/compose.yaml on a machine with Docker (docs/deploy.md, "Checked here"):
#   1. brings the pool up (the image llm-pool:0.1.0 must exist, or pass --build);
#   2. waits until the coordinator counts 5 workers alive, and lists what they advertise;
#   3. sends a request and prints its `done` event, then each container's memory;
#   4. stops the coordinator while a 200-token stream runs: the stream must still end with `done`
#      (the drain lets it finish) and the coordinator must exit 0;
#   5. stops the workers (each must exit 0) and removes the containers and the network.
# Prints FAIL and exits 1 at the first check that does not hold.
#
#   deploy/compose-smoke.sh [--build] [--provision-on-host-network] [--keep-volume]
#
# --provision-on-host-network: put the model into the compose volume first from a container on the
# host's network (same image, user and command as the `model` service), for a Docker whose bridge
# networks have no outbound access; the `model` service then finds the file and exits 0.
set -euo pipefail
trap 'echo "FAIL: line $LINENO"; cleanup' ERR
cd "$(dirname "${BASH_SOURCE[0]}")/.."
project=llm-pool
compose=(docker compose)
docker compose version >/dev/null 2>&1 || compose=(docker-compose)
compose+=(-f deploy/compose.yaml -p "$project")
url="http://127.0.0.1:${PORT:-1337}"
model=/models/SmolLM2-135M-Instruct.Q4_1.gguf
build=--no-build host_provision=0 keep_volume=0
for arg in "$@"; do
    case "$arg" in
        --build) build=--build ;;
        --provision-on-host-network) host_provision=1 ;;
        --keep-volume) keep_volume=1 ;;
        *) echo "compose-smoke: unknown argument $arg" >&2; exit 2 ;;
    esac
done

now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$1" "$(now)"; }
fail() { echo "FAIL: $*"; "${compose[@]}" logs --no-color --tail 20 >&2 || true; cleanup; exit 1; }
cleanup() {
    if [ "$keep_volume" = 1 ]; then "${compose[@]}" down >/dev/null 2>&1 || true
    else "${compose[@]}" down -v >/dev/null 2>&1 || true; fi
}
infer() {  # infer MAX_TOKENS PROMPT: the SSE stream of one request
    curl -sN --max-time 120 "$url/coordinator/infer" -H 'content-type: application/json' \
        -d "{\"prompt\": \"$2\", \"max_tokens\": $1, \"ignore_eos\": true}"
}

if [ "$host_provision" = 1 ]; then
    started=$(now)
    docker volume create "${project}_models" >/dev/null
    docker run --rm --network host -v "${project}_models:/models" llm-pool:0.1.0 \
        python -m worker.provision --target "$model" 2>&1 | tail -1
    echo "model provisioned into the volume in $(since "$started")"
fi

started=$(now)
"${compose[@]}" up -d "$build" >/dev/null 2>&1 || fail "compose up"
alive=0
for _ in $(seq 1 240); do
    alive=$(curl -s --max-time 2 "$url/coordinator/health" \
            | python3 -c 'import json, sys; print(json.load(sys.stdin)["workers"]["alive"])' 2>/dev/null || echo 0)
    [ "$alive" = 5 ] && break
    sleep 0.5
done
[ "$alive" = 5 ] || fail "$alive workers alive after $(since "$started")"
echo "5 workers alive $(since "$started") after compose up"
curl -s "$url/coordinator/health/workers" | python3 -c '
import json, sys
for w in json.load(sys.stdin)["workers"]:
    print("  %s advertises %s, serves %s" % (w["worker_id"], w["url"], w["model"]))'

done_event=$(infer 16 "What is the capital of France?" | grep -A1 '^event: done' | tail -1)
[ -n "$done_event" ] || fail "no done event"
echo "one request: ${done_event:0:160}..."
echo "memory per container:"
docker stats --no-stream --format '  {{.Name}} {{.MemUsage}}' \
    $("${compose[@]}" ps -q coordinator worker-1 worker-2 worker-3 worker-4 worker-5)

stream=$(mktemp)
infer 200 "Write a long story about the sea." > "$stream" &
reader=$!
sleep 1.5
stopping=$(now)
"${compose[@]}" stop -t 60 coordinator >/dev/null 2>&1
echo "coordinator stopped in $(since "$stopping") with a stream running"
wait "$reader" || true
tokens=$(grep -c '^event: token' "$stream" || true)
last=$(grep '^event:' "$stream" | tr -d '\r' | tail -1 || true)
rm -f "$stream"
[ "$last" = "event: done" ] || fail "the running stream ended with '$last' after $tokens tokens"
echo "the running stream finished: $tokens tokens, then done"
code=$(docker inspect -f '{{.State.ExitCode}}' "$("${compose[@]}" ps -q coordinator)")
[ "$code" = 0 ] || fail "coordinator exit status $code"

stopping=$(now)
"${compose[@]}" stop -t 60 >/dev/null 2>&1
echo "workers stopped in $(since "$stopping")"
for id in $("${compose[@]}" ps -q); do
    code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
    [ "$code" = 0 ] || fail "$(docker inspect -f '{{.Name}}' "$id") exit status $code"
done
cleanup
echo "OK"
