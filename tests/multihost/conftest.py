"""The multi-host pool: a real coordinator and five real workers, each on its own "host" (network
namespace) on one bridge, and a client host the test talks from.

    198.18.0.1   coordinator  python -m coordinator --host 198.18.0.1 --port 1337
    198.18.0.2   client       the test's HTTP calls (threads inside this namespace)
    198.18.0.11-15  w1..w5    python -m worker --host 198.18.0.1N --port 3001 (the default model)

Workers register by heartbeat over the bridge and advertise their 198.18 address. One pool serves
the whole module (five model loads on two cores take a while); each test starts with `pool.ensure()`.
The network and every process are removed at teardown however the tests ended.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import clean_env
from tests.multihost.client import Client
from tests.multihost.netns import Host, Network, Proc, missing_requirements

TOKEN = "multihost-secret"
COORDINATOR_PORT = 1337
WORKER_PORT = 3001
WORKERS = ("w1", "w2", "w3", "w4", "w5")

# The coordinator's deadlines on a worker, passed explicitly (at their defaults) because the partition
# test's bounds are read from them. Heartbeats are faster than the default 10 s to keep the module short.
HEARTBEAT_INTERVAL = 1.0  # a worker is stale after 3 of them, removed after 6
CONNECT_TIMEOUT = 2.0
FIRST_EVENT_TIMEOUT = 120.0
READ_TIMEOUT = 5.0  # the longest silence from a worker, which pings every protocol.worker.PING_INTERVAL
COORDINATOR_FLAGS = [
    "--heartbeat-interval", str(HEARTBEAT_INTERVAL), "--worker-token", TOKEN,
    "--worker-connect-timeout", str(CONNECT_TIMEOUT), "--worker-first-event-timeout", str(FIRST_EVENT_TIMEOUT),
    "--worker-read-timeout", str(READ_TIMEOUT),
    # Round-robin: every host gets its share of the latency test's samples however loaded the machine
    # is (the load-based default sent 5 of 400 to one host during a full, busy test run).
    "--routing-policy", "round-robin",
    # A drained worker's sessions are moved through the coordinator; a move whose source or target
    # falls silent gives up after this long (the default 30 s would only make the partition test slow).
    "--session-move-timeout", "5",
]
WORKER_FLAGS = ["--threads", "1", "--max-sessions", "2", "--session-max-tokens", "512",
                "--heartbeat-interval", "0.5", "--worker-token", TOKEN]
START_TIMEOUT = 120.0


def coordinator_argv(host: Host, flags: list[str]) -> list[str]:
    """A coordinator on `host`'s address, on COORDINATOR_PORT."""
    return [sys.executable, "-m", "coordinator", "--host", host.address, "--port", str(COORDINATOR_PORT), *flags]


def worker_argv(host: Host, worker_id: str, coordinator_urls: list[str], model_path: Path,
                flags: list[str]) -> list[str]:
    """A worker on `host`'s address, on WORKER_PORT, advertising that address, heartbeating to every
    one of `coordinator_urls`."""
    return [sys.executable, "-m", "worker", "--host", host.address, "--port", str(WORKER_PORT),
            "--worker-id", worker_id, "--worker-url", f"http://{host.address}:{WORKER_PORT}",
            "--coordinator-url", ",".join(coordinator_urls), "--model-path", str(model_path), *flags]


@dataclass
class Pool:
    network: Network
    client: Client
    coordinator: Proc
    workers: dict[str, Proc]
    worker_argv: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    def host(self, worker_id: str) -> Host:
        return self.network.hosts[worker_id]

    def states(self) -> dict[str, dict[str, Any]]:
        listing = self.client.get("/coordinator/health/workers")["workers"]
        return {w["worker_id"]: w for w in listing}

    def logs(self) -> str:
        procs = [self.coordinator, *self.workers.values()]
        return "\n".join(f"--- {p.name} ({'running' if p.running else f'exit {p.popen.returncode}'}):\n"
                         f"{p.log_tail(8)}" for p in procs)

    def restart(self, worker_id: str, timeout: float = 60.0) -> None:
        """Starts `worker_id` again on its host once its process has ended (a drain), then waits for the
        whole pool to be ready."""
        old = self.workers[worker_id]
        old.popen.wait(timeout=timeout)
        self.workers[worker_id] = self.network.spawn(self.host(worker_id).namespace, worker_id,
                                                     self.worker_argv[worker_id], self.env)
        self.ensure()

    def ensure(self, timeout: float = START_TIMEOUT) -> None:
        """Every worker alive in the coordinator's eyes and idle, and nothing in flight."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            dead = [p.name for p in (self.coordinator, *self.workers.values()) if not p.running]
            assert not dead, f"{dead} exited:\n{self.logs()}"
            try:
                states = self.states()
                health = self.client.get("/coordinator/health")
            except Exception as exc:  # noqa: BLE001 - the coordinator may still be starting
                last = exc
            else:
                last = {w: (s["state"], s["sessions"], s["active_streams"]) for w, s in states.items()}
                if (all(states.get(w, {}).get("state") == "alive" and states[w]["sessions"] == 0
                        and states[w]["active_streams"] == 0 for w in WORKERS)
                        and health["requests_running"] == 0):
                    return
            time.sleep(0.2)
        raise AssertionError(f"the pool was not ready within {timeout:g} s (last: {last!r})\n{self.logs()}")


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    log_dir = tmp_path_factory.mktemp("multihost")
    network = Network(log_dir)
    client: Client | None = None
    pool: Pool | None = None
    try:
        network.create()
        coordinator_host = network.add_host("coord", "198.18.0.1")
        client_host = network.add_host("client", "198.18.0.2")
        workers = {w: network.add_host(w, f"198.18.0.{10 + i}") for i, w in enumerate(WORKERS, start=1)}
        coordinator_url = f"http://{coordinator_host.address}:{COORDINATOR_PORT}"
        env = clean_env()
        coordinator = network.spawn(coordinator_host.namespace, "coordinator",
                                    coordinator_argv(coordinator_host, COORDINATOR_FLAGS), env)
        argv = {w: worker_argv(host, w, [coordinator_url], model_path, WORKER_FLAGS) for w, host in workers.items()}
        procs = {w: network.spawn(host.namespace, w, argv[w], env) for w, host in workers.items()}
        client = Client(client_host.namespace, coordinator_url)
        pool = Pool(network, client, coordinator, procs, argv, dict(env))
        started = time.monotonic()
        pool.ensure()
        pool.figures["pool_ready_s"] = round(time.monotonic() - started, 1)
        yield pool
    finally:
        if pool is not None and pool.figures:
            path = log_dir / "multihost-figures.json"
            path.write_text(json.dumps(pool.figures, indent=2) + "\n")
            print(f"\nmulti-host figures ({path}):\n{json.dumps(pool.figures, indent=2)}")
        network.close()  # first: a stream still open then ends at once, and the client's threads with it
        if client is not None:
            client.close()
