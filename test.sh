#!/usr/bin/env bash
# The test command: bootstraps what is missing (.venv, packages, the default model, Chromium), checks ruff,
# mypy and the import layers, then runs every test: unit tests per module and integration tests over
# real processes with the real model.
#   ./test.sh                 everything (what CI runs)
#   ./test.sh --fast          the unit and model rungs of the test ladder only (tests/conftest.py)
#   ./test.sh tests/worker -k session     extra arguments go to pytest
#   TEST_WORKERS=0 ./test.sh tests/x.py -s    one process (for -s, --pdb); TEST_WORKERS=N: N processes (3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${VENV:-$(if [ "${LLAMA_CUDA:-0}" = 1 ]; then echo .venv-cuda; else echo .venv; fi)}"
rungs="unit or model or process or load"  # every rung
fast=0
if [ "${1:-}" = "--fast" ]; then
    shift
    fast=1 rungs="not process and not load"  # the unit and model rungs
fi
scripts/bootstrap.sh
if [ "$fast" = 0 ]; then
    scripts/test-deps.sh  # the browser test's Chromium (Debian packages), when missing
    scripts/agent-clis.sh  # Claude Code and Codex CLI (npm, pinned), for the agents' process tests
fi
# Lint and types first: the style guide asks both to be clean, so the tests hold them to it.
"$venv"/bin/ruff check --quiet .
"$venv"/bin/mypy --no-error-summary worker protocol coordinator bench
"$venv"/bin/lint-imports --no-cache --no-logo  # the rooms' layers (pyproject.toml, [tool.importlinter])
# Three test processes, each taking a whole file at a time (its module's pool with it), the longest files
# first (tests/conftest.py): most tests wait on a pool (its start, its heartbeats, its streams), so three
# keep the two cores busier than two did (2026-11-28, 2-core machine: the same 1,875 tests in 278 s on
# three, 318 s on two, 276 s on four). Then, alone, the `solo` tests: they compare a pace or a throughput between phases of their own run, which the other
# process's load would skew. TEST_WORKERS=0 runs everything in this one process, in one go.
named_path=0
for arg in "$@"; do
    if [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ]; then named_path=1; fi
done
# With --fast and no path named, the process folders are not collected: every test there starts
# processes (tests/conftest.py), so none is on the fast rungs (1-1.5 s of CPU less per test process).
skipped=()
if [ "$fast" = 1 ] && [ "$named_path" = 0 ]; then
    skipped=(--ignore=tests/integration --ignore=tests/faults --ignore=tests/multihost)
fi
if [ "${TEST_WORKERS:-3}" = 0 ]; then
    exec "$venv"/bin/python -m pytest -m "$rungs" "${skipped[@]}" "$@"
fi
first=0 second=0
"$venv"/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    -m "($rungs) and not solo" "${skipped[@]}" "$@" || first=$?
# Without a path among the arguments, only the files that mark a test `solo` are collected (4 s less
# than collecting every file to keep 6 tests); with --fast, none of the process folders', and with no
# file left the second run is not started.
solo_files=()
if [ "$named_path" = 0 ]; then
    mapfile -t solo_files < <(grep -rlE "pytest\.mark\.solo" tests --include='test_*.py' | sort)
    if [ "$fast" = 1 ]; then
        mapfile -t solo_files < <(printf '%s\n' "${solo_files[@]}" | grep -vE '^(tests/(integration|faults|multihost)/|$)')
    fi
fi
if [ "$named_path" = 1 ] || [ "${#solo_files[@]}" -gt 0 ]; then
    "$venv"/bin/python -m pytest -m "($rungs) and solo" "$@" "${solo_files[@]}" || second=$?
else
    second=5
fi
# pytest's codes; 5 is "collected nothing", which fails the command only when both runs say it.
if [ "$first" = 5 ] && [ "$second" = 5 ]; then
    exit 5
fi
for code in "$first" "$second"; do
    case "$code" in 0 | 5) ;; *) exit "$code" ;; esac
done
