#!/usr/bin/env bash
# The test command: bootstraps what is missing (.venv, packages, the default model, Chromium), checks ruff,
# mypy and the import layers, then runs every test: unit tests per module and integration tests over
# real processes with the real model.
#   ./test.sh                 everything (what CI runs)
#   ./test.sh --fast          the unit and model rungs of the test ladder only (tests/conftest.py)
#   ./test.sh tests/worker -k session     extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${VENV:-$(if [ "${LLAMA_CUDA:-0}" = 1 ]; then echo .venv-cuda; else echo .venv; fi)}"
rungs=()
if [ "${1:-}" = "--fast" ]; then
    shift
    rungs=(-m "not process and not load")
fi
scripts/bootstrap.sh
if [ ${#rungs[@]} -eq 0 ]; then
    scripts/test-deps.sh  # the browser test's Chromium (Debian packages), when missing
fi
# Lint and types first: the style guide asks both to be clean, so the tests hold them to it.
"$venv"/bin/ruff check --quiet .
"$venv"/bin/mypy --no-error-summary worker protocol coordinator bench
"$venv"/bin/lint-imports --no-cache --no-logo  # the rooms' layers (pyproject.toml, [tool.importlinter])
exec "$venv"/bin/python -m pytest "${rungs[@]}" "$@"
