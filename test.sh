#!/usr/bin/env bash
# The test command: bootstraps what is missing (.venv, packages, the default model, Chromium), checks ruff,
# mypy and the import layers, then runs every test: unit tests per module and integration tests over real processes with
# the real model.
# Extra arguments go to pytest, e.g. ./test.sh tests/worker -k session
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${VENV:-$(if [ "${LLAMA_CUDA:-0}" = 1 ]; then echo .venv-cuda; else echo .venv; fi)}"
scripts/bootstrap.sh
scripts/test-deps.sh  # the browser test's Chromium (Debian packages), when missing
# Lint and types first: the style guide asks both to be clean, so the tests hold them to it.
"$venv"/bin/ruff check --quiet .
"$venv"/bin/mypy --no-error-summary worker protocol coordinator bench
"$venv"/bin/lint-imports --no-cache --no-logo  # the rooms' layers (pyproject.toml, [tool.importlinter])
exec "$venv"/bin/python -m pytest "$@"
