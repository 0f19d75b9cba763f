#!/usr/bin/env bash
# lm-evaluation-harness against the pool, offline: starts ./start.sh (a coordinator and two workers on the
# default model), runs the two small tasks of bench/eval_tasks (multiple choice, scored by log-likelihood
# through /v1/completions with echo and logprobs; and greedy generation), prints lm-eval's table, and
# stops the pool however the run ends. docs/evaluation.md has the figures.
#
#   bench/lm_eval_run.sh                  # the pool on port 1437
#   LM_EVAL_VENV=/opt/lm-eval bench/lm_eval_run.sh
#
# lm-eval pulls in PyTorch, so it stays out of the project's dependencies: it is installed, on first use,
# into its own virtual environment ($LM_EVAL_VENV, /tmp/lm-eval-venv by default), with the CPU build of
# torch 2.13.0 that pip finds on this machine's disk.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${LM_EVAL_VENV:-/tmp/lm-eval-venv}"
port="${LM_EVAL_PORT:-1437}"
if [ ! -x "$venv/bin/lm_eval" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==2.13.0" "lm-eval[api]==0.4.13"
fi
log="$(mktemp)"
PORT="$port" WORKER_BASE_PORT="$((port + 10))" ./start.sh > "$log" 2>&1 &
pool=$!
stop() {
    kill -TERM "$pool" 2> /dev/null || true
    wait "$pool" 2> /dev/null || true
    rm -f "$log"
}
trap stop EXIT
for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$port/coordinator/ready" > /dev/null; then
        break
    fi
    if ! kill -0 "$pool" 2> /dev/null; then
        cat "$log"
        exit 1
    fi
    sleep 1
done
model="$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$venv/bin/lm_eval" run --model local-completions \
    --model_args "base_url=http://127.0.0.1:$port/v1/completions,model=$model,tokenizer_backend=remote,num_concurrent=1,max_retries=1" \
    --include_path bench/eval_tasks --tasks pool_mc,pool_gen "$@"
