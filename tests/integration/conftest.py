"""Process fixtures for integration tests: the real coordinator and two real workers on loopback.

One cluster serves the whole integration session (loading the model twice costs ~2 s; starting it
per test would dominate the run). Tests that kill or stop a worker leave it to `cluster.ensure()`,
which runs before every test, to bring the cluster back to two idle, alive workers.
Every wait here has a deadline; every process is killed at teardown. The pools of other tests
(tests/faults, test_queue.py, test_status_page.py) start theirs with the same helpers
(`start_coordinator`, `start_worker`, `running_cluster`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coordinator.settings import Settings
from tests.conftest import free_port
from tests.polling import wait_until

TOKEN = "integration-secret"
COORDINATOR_HEARTBEAT = 1.0  # stale after 3 s, removed after 6 s
WORKER_HEARTBEAT = 0.5
# Small enough that capacity runs out with a handful of streams: 1,024 KV cells shared by at most
# 4 sessions of at most 512 tokens each.
WORKER_LIMITS = ["--kv-unified", "--ctx-size", "1024", "--max-sessions", "4", "--session-max-tokens", "512"]


def clean_env() -> dict[str, str]:
    """The environment without anything either service would read as configuration."""
    names = {name.upper() for name in Settings.model_fields} | {"MODEL_PATH", "COORDINATOR_URL"}
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith("WORKER_")}


@contextlib.contextmanager
def folder_pool(log_dir: Path, model_path: Path, gemma_path: Path, worker_id: str,
                *flags: str) -> Iterator[tuple[str, Proc, int]]:
    """A coordinator and one worker, `worker_id`, offering a folder of SmolLM2 (`a-smol.gguf`) and Gemma
    (`b-gemma.gguf`), 2 sequences of 512 tokens, with `flags` more; (the coordinator's URL, the worker,
    its port) once it is registered."""
    folder = log_dir / "models"
    folder.mkdir()
    (folder / "a-smol.gguf").symlink_to(model_path)
    (folder / "b-gemma.gguf").symlink_to(gemma_path)
    coordinator, url = start_coordinator(log_dir, f"coordinator-{worker_id}", "--heartbeat-interval", "1")
    port = free_port()
    worker = Proc(worker_id, [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", worker_id,
                              "--coordinator-url", url, "--model-dir", str(folder), "--max-sessions", "2",
                              "--session-max-tokens", "512", "--threads", "1", "--heartbeat-interval", "0.5",
                              *flags], log_dir / f"{worker_id}.log")
    worker.start()
    try:
        wait_until(lambda: alive_worker(url, worker_id) is not None, 60, "the worker to register", interval=0.2)
        yield url, worker, port
    finally:
        stop_all([worker, coordinator])


def alive_worker(coordinator_url: str, worker_id: str) -> dict[str, Any] | None:
    """The coordinator's listing of `worker_id` (/coordinator/health/workers) while it is alive, else None."""
    workers = httpx.get(coordinator_url + "/coordinator/health/workers", timeout=2).json()["workers"]
    return next((w for w in workers if w["worker_id"] == worker_id and w["state"] == "alive"), None)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
                                      start_new_session=True)
        log.close()

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.popen is not None
            os.kill(self.popen.pid, sig)

    def stop(self) -> None:
        self.terminate()
        self.reap()

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT, should a test have stopped it): it drains and exits."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def reap(self) -> None:
        """Waits for it to exit, 5 s at most, then kills it."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)


def stop_all(procs: Iterable[Proc]) -> None:
    """Every one told to stop at once, then each waited for: their drains overlap instead of adding up."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.reap()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_coordinator(log_dir: Path, name: str, *extra: str, port: int | None = None) -> tuple[Proc, str]:
    """A real coordinator on `port` (a free one if none: a pool that restarts its coordinator keeps the
    port its workers know), answering once this returns; the process and its URL. With `--own-port`
    it answers there first (it joins a shared `port` once it knows the pool), so that is what is awaited."""
    port = free_port() if port is None else port
    proc = Proc(name, [sys.executable, "-m", "coordinator", "--port", str(port), *extra], log_dir / f"{name}.log")
    proc.start()
    url = f"http://127.0.0.1:{port}"
    own = extra[extra.index("--own-port") + 1] if "--own-port" in extra else None
    answering = f"http://127.0.0.1:{own}" if own else url
    wait_until(lambda: httpx.get(answering + "/coordinator/health", timeout=1).status_code == 200, 30,
               f"{name} to answer")
    return proc, url


def start_worker(log_dir: Path, worker_id: str, coordinator_url: str, model_path: Path, *extra: str,
                 ) -> tuple[Proc, str]:
    """A real worker on a free loopback port, registering with `coordinator_url`; the process and its
    URL. It is still loading when this returns: wait for it through the coordinator."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(worker_id, [
        sys.executable, "-m", "worker", "--host", "127.0.0.1", "--port", str(port), "--worker-id", worker_id,
        "--worker-url", url, "--coordinator-url", coordinator_url, "--model-path", str(model_path), *extra],
        log_dir / f"{worker_id}.log")
    proc.start()
    return proc, url


@dataclass
class Cluster:
    log_dir: Path
    model_path: Path
    coordinator: Proc
    url: str
    workers: dict[str, Proc] = field(default_factory=dict)
    worker_urls: dict[str, str] = field(default_factory=dict)

    def start_worker(self, worker_id: str) -> None:
        self.workers[worker_id], self.worker_urls[worker_id] = start_worker(
            self.log_dir, worker_id, self.url, self.model_path, "--threads", "1",
            "--heartbeat-interval", str(WORKER_HEARTBEAT), "--worker-token", TOKEN, *WORKER_LIMITS)

    def states(self) -> dict[str, dict]:  # type: ignore[type-arg]
        listing = httpx.get(self.url + "/coordinator/health/workers", timeout=2).json()["workers"]
        return {w["worker_id"]: w for w in listing}

    def worker_load(self, worker_id: str) -> dict:  # type: ignore[type-arg]
        """The worker's own load report (ValueError while it loads, which `wait_until` retries)."""
        load = httpx.get(self.worker_urls[worker_id] + "/worker/health", timeout=2).json()["load"]
        if load is None:
            raise ValueError(f"{worker_id} is loading")
        return load  # type: ignore[no-any-return]

    def coordinator_health(self) -> dict:  # type: ignore[type-arg]
        return httpx.get(self.url + "/coordinator/health", timeout=2).json()

    def ensure(self) -> None:
        """Two alive, idle workers and no request in flight, whatever the last test did."""
        assert self.coordinator.running, self.coordinator.log_tail()
        for worker_id, proc in self.workers.items():
            proc.signal(signal.SIGCONT)
            if not proc.running:
                self.start_worker(worker_id)
        for worker_id in self.workers:
            # The URL tells a restarted worker (new port) from the record its dead predecessor left.
            wait_until(lambda w=worker_id: self.states().get(w, {}).get("state") == "alive"
                       and self.states()[w]["url"] == self.worker_urls[w], 60, f"{worker_id} to be alive",
                       interval=0.2)
            wait_until(lambda w=worker_id: self.worker_load(w)["active_streams"] == 0, 30, f"{worker_id} idle")
            # And the coordinator has heard so: until the next heartbeat it still sees the last
            # test's sessions, and would schedule around a worker it thinks is full.
            wait_until(lambda w=worker_id: _idle(self.states()[w]), 10, f"the coordinator to see {worker_id} idle")
        wait_until(lambda: self.coordinator_health()["requests_running"] == 0, 10, "no request in flight")

    def stop(self) -> None:
        stop_all([*self.workers.values(), self.coordinator])


def _idle(status: dict) -> bool:  # type: ignore[type-arg]
    return bool(status["sessions"] == 0 and status["active_streams"] == 0)


@contextlib.contextmanager
def running_cluster(log_dir: Path, model_path: Path, coordinator_name: str, *coordinator_flags: str,
                    kind: type[Cluster] = Cluster) -> Iterator[Cluster]:
    """A coordinator started with `coordinator_flags` and the workers w1 and w2 (as `kind` starts them),
    alive and idle; all stopped however the block ends."""
    coordinator, url = start_coordinator(log_dir, coordinator_name, *coordinator_flags)
    cluster = kind(log_dir, model_path, coordinator, url)
    try:
        for worker_id in ("w1", "w2"):
            cluster.start_worker(worker_id)
        cluster.ensure()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster_session(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
            tmp_path_factory.mktemp("cluster-logs"), model_path, "coordinator",
            "--heartbeat-interval", str(COORDINATOR_HEARTBEAT), "--worker-token", TOKEN,
            "--relay-buffer-events", "16", "--relay-write-deadline", "2", "--worker-first-event-timeout", "20",
            "--retry-after", "1",
            # No admission queue: these tests check the immediate 503s; test_queue.py has its own pool.
            "--queue-size", "0") as cluster:
        yield cluster


@pytest.fixture
def cluster(cluster_session: Cluster) -> Cluster:
    cluster_session.ensure()
    return cluster_session


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def sdk(cluster: Cluster) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official OpenAI client against the shared cluster's coordinator."""
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    await client.close()
