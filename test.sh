#!/usr/bin/env bash
# The test command: bootstraps what is missing (.venv, packages, the default model), then runs
# every test: unit tests per module and integration tests over real processes with the real model.
# Extra arguments go to pytest, e.g. ./test.sh tests/worker -k session
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
