"""The fault suite's pool: a real coordinator and real workers on loopback, with short drain deadlines
and the flags a test chooses, restarted by `FaultPool.ensure()` (tests here kill, stop and drain them);
what the tests read from it (`held`, `worker_load`); and `periodically`, for sampling it while a test runs.
The processes are the integration suite's (`start_coordinator`, `start_worker`, `Proc`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator, start_worker
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
    """A coordinator on a port of its own (restarted on the same port, its workers re-register) and the
    workers `worker_ids`, each started with the flags given."""

    log_dir: Path
    model_path: Path
    coordinator_flags: list[str] = field(default_factory=lambda: list(COORDINATOR_FLAGS))
    worker_flags: list[str] = field(default_factory=lambda: list(WORKER_FLAGS))
    worker_ids: tuple[str, ...] = ("f1", "f2")
    port: int = field(default_factory=free_port)
    coordinator: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    worker_urls: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_coordinator(self) -> None:
        self.coordinator, _ = start_coordinator(self.log_dir, "coordinator", *self.coordinator_flags, port=self.port)

    def restart_coordinator(self, flags: list[str]) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        self.coordinator_flags = flags
        self.ensure()

    def start_worker(self, worker_id: str) -> None:
        self.workers[worker_id], self.worker_urls[worker_id] = start_worker(
            self.log_dir, worker_id, self.url, self.model_path, *self.worker_flags)

    def listing(self) -> dict[str, dict[str, Any]]:
        workers = httpx.get(self.url + "/coordinator/health/workers", timeout=2).json()["workers"]
        return {w["worker_id"]: w for w in workers}

    def worker_health(self, worker_id: str) -> httpx.Response:
        return httpx.get(self.worker_urls[worker_id] + "/worker/health", timeout=2)

    def worker_load(self, worker_id: str) -> dict[str, Any]:
        """The worker's own load report (ValueError while it loads, which `wait_until` retries)."""
        load = self.worker_health(worker_id).json()["load"]
        if load is None:
            raise ValueError(f"{worker_id} is loading")
        return load  # type: ignore[no-any-return]

    def coordinator_health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/coordinator/health", timeout=2).json()  # type: ignore[no-any-return]

    def held(self) -> dict[str, dict[str, int]]:
        """Every session, reservation and KV cell still held, in the coordinator's view and on each worker
        (only the counters that are not 0): empty when all are back to 0."""
        found = {}
        health = self.coordinator_health()
        found["coordinator"] = {k: health[k] for k in ("requests_running", "kv_reserved_bytes") if health[k]}
        for worker_id, seen in self.listing().items():
            found[f"view of {worker_id}"] = {k: seen[k] for k in ("sessions", "in_flight", "kv_reserved_bytes",
                                                                  "kv_used_bytes") if seen[k]}
        for worker_id in self.worker_urls:
            load = self.worker_load(worker_id)
            found[worker_id] = {k: load[k] for k in ("sessions", "active_streams", "kv_used_bytes",
                                                     "kv_reserved_bytes") if load[k]}
        return {where: counters for where, counters in found.items() if counters}

    def ensure(self) -> None:
        """A running coordinator and every worker alive and idle, whatever the last test did."""
        if self.coordinator is None or not self.coordinator.running:
            self.start_coordinator()
        for worker_id in self.worker_ids:
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

        for worker_id in self.worker_ids:
            wait_until(lambda w=worker_id: idle(w), 60, f"{worker_id} alive and idle", interval=0.2)

    def stop(self) -> None:
        for proc in [*self.workers.values(), *([self.coordinator] if self.coordinator else [])]:
            proc.stop()


def pool_fixture(name: str, **tuning: Any) -> Any:
    """A module-scoped `FaultPool` fixture (`tuning`: its flags and worker ids), started before the
    module's tests and stopped after them."""

    @pytest.fixture(scope="module")
    def fixture(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPool]:
        pool = FaultPool(tmp_path_factory.mktemp(name), model_path, **tuning)
        try:
            pool.ensure()
            yield pool
        finally:
            pool.stop()

    return fixture


def pid(proc: Proc | None) -> int:
    assert proc is not None and proc.popen is not None
    return proc.popen.pid


@contextlib.contextmanager
def periodically(seconds: float, sample: Callable[[], None]) -> Iterator[None]:
    """Calls `sample` every `seconds`, in a thread, while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(seconds):
            sample()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
