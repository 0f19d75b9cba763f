"""Fixtures shared by every test package: the real model, free loopback ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from worker.provision import DEFAULT_MODEL_PATH, is_provisioned


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
