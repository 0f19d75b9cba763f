"""Fixtures shared by every test package: the real model, free loopback ports."""

from __future__ import annotations

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
    from worker.model import Model

    loaded = Model(model_path)
    yield loaded
    loaded.close()
