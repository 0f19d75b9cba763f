"""The fault suite's pool: a real coordinator and two real workers on loopback, with short drain
deadlines, restarted by `FaultPool.ensure()` before each test (tests here kill, stop and drain them).
Every figure a test measures is printed and appended to `figures.jsonl` under the pytest tmp dir."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc
from tests.polling import wait_until

COORDINATOR_DRAIN = 3.0
WORKER_DRAIN = 2.0
WORKER_HEARTBEAT = 0.5
COORDINATOR_FLAGS = ["--heartbeat-interval", "1", "--retry-after", "1", "--queue-size", "0",
                     "--drain-timeout", str(COORDINATOR_DRAIN)]
WORKER_FLAGS = ["--threads", "1", "--max-sessions", "4", "--session-max-tokens", "512",
                "--heartbeat-interval", str(WORKER_HEARTBEAT), "--drain-timeout", str(WORKER_DRAIN)]


@dataclass
class FaultPool:
    log_dir: Path
    model_path: Path
    port: int = field(default_factory=free_port)
    coordinator: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    worker_urls: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_coordinator(self) -> None:
        self.coordinator = Proc("coordinator", [sys.executable, "-m", "coordinator", "--port", str(self.port),
                                                *COORDINATOR_FLAGS], self.log_dir / "coordinator.log")
        self.coordinator.start()
        wait_until(lambda: httpx.get(self.url + "/coordinator/health", timeout=1).status_code == 200, 30,
                   "the coordinator to answer")

    def start_worker(self, worker_id: str) -> None:
        port = free_port()
        self.worker_urls[worker_id] = f"http://127.0.0.1:{port}"
        proc = Proc(worker_id, [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", worker_id,
                                "--coordinator-url", self.url, "--model-path", str(self.model_path), *WORKER_FLAGS],
                    self.log_dir / f"{worker_id}.log")
        proc.start()
        self.workers[worker_id] = proc

    def listing(self) -> dict[str, dict[str, Any]]:
        workers = httpx.get(self.url + "/coordinator/health/workers", timeout=2).json()["workers"]
        return {w["worker_id"]: w for w in workers}

    def worker_health(self, worker_id: str) -> httpx.Response:
        return httpx.get(self.worker_urls[worker_id] + "/worker/health", timeout=2)

    def ensure(self) -> None:
        """A running coordinator and two alive, idle workers, whatever the last test did."""
        if self.coordinator is None or not self.coordinator.running:
            self.start_coordinator()
        for worker_id in ("f1", "f2"):
            proc = self.workers.get(worker_id)
            if proc is not None:
                proc.signal(signal.SIGCONT)
            if proc is None or not proc.running:
                self.start_worker(worker_id)

        def idle(w: str) -> bool:
            seen = self.listing().get(w)
            return (seen is not None and seen["state"] == "alive" and seen["url"] == self.worker_urls[w]
                    and not seen["draining"] and seen["sessions"] == 0 and seen["in_flight"] == 0
                    and seen["breaker"] == "closed")

        for worker_id in self.workers:
            wait_until(lambda w=worker_id: idle(w), 60, f"{worker_id} alive and idle", interval=0.2)

    def stop(self) -> None:
        for proc in [*self.workers.values(), *([self.coordinator] if self.coordinator else [])]:
            proc.stop()


@pytest.fixture(scope="module")
def fault_pool_module(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPool]:
    pool = FaultPool(tmp_path_factory.mktemp("faults"), model_path)
    try:
        yield pool
    finally:
        pool.stop()


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
