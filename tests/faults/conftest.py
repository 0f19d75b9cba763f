"""The fault suite's fixtures: the pool (tests/faults/pool.py: a real coordinator and two real workers
on loopback, with short drain deadlines), brought back by `FaultPool.ensure()` before each test (tests
here kill, stop and drain them), and the figures: every figure a test measures is printed and appended
to `figures.jsonl` under the pytest tmp dir."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults.pool import FaultPool, pool_fixture

fault_pool_module = pool_fixture("faults")


@pytest.fixture
def fault_pool(fault_pool_module: FaultPool) -> FaultPool:
    fault_pool_module.ensure()
    return fault_pool_module


@pytest.fixture(scope="session")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Each test appends {"case": ..., figures...}; written out and printed at the end of the session."""
    found: list[dict[str, Any]] = []
    yield found
    path = tmp_path_factory.getbasetemp() / "figures.jsonl"
    path.write_text("".join(json.dumps(f) + "\n" for f in found))
    for f in found:
        print("FIGURE", json.dumps(f))


def since(started: float) -> float:
    return round(time.monotonic() - started, 3)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
