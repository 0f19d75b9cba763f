"""Two coordinators on two hosts, one pool: two worker hosts heartbeat to both (COORDINATOR_URL lists
them), and the pool survives either coordinator host being cut off: the other keeps every worker
alive in its registry and serves, and the one cut off serves again once it is plugged back.

    198.18.0.1, 198.18.0.3   c1, c2       python -m coordinator --host 198.18.0.N --port 1337
    198.18.0.2               client       the test's HTTP calls (threads inside this namespace)
    198.18.0.21-22           v1, v2       python -m worker (the default model)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import clean_env
from tests.multihost.client import Client
from tests.multihost.conftest import COORDINATOR_PORT, coordinator_argv, worker_argv
from tests.multihost.netns import Host, Network, Proc, missing_requirements

pytestmark = pytest.mark.model
TOKEN = "two-coordinators-secret"
HEARTBEAT_INTERVAL = 1.0  # the coordinators': a worker is stale after 3 s without a beat, removed after 6
WORKERS = ("v1", "v2")
SHORT = {"prompt": "Say hello.", "max_tokens": 4, "ignore_eos": True}


@dataclass
class TwoCoordinators:
    network: Network
    hosts: dict[str, Host]
    clients: dict[str, Client]  # by coordinator: a client of c1 and one of c2, both on the client host
    procs: dict[str, Proc]

    def states(self, coordinator: str) -> dict[str, str]:
        listing = self.clients[coordinator].get("/coordinator/health/workers")["workers"]
        return {w["worker_id"]: w["state"] for w in listing}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.log_tail(8)}" for p in self.procs.values())


def wait_for(check: Any, timeout: float, what: str, pool: TwoCoordinators) -> float:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a coordinator still starting, or cut off
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})\n{pool.logs()}")


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoCoordinators]:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    network = Network(tmp_path_factory.mktemp("two-coordinators"))
    clients: dict[str, Client] = {}
    try:
        network.create()
        hosts = {"c1": network.add_host("c1", "198.18.0.1"), "c2": network.add_host("c2", "198.18.0.3"),
                 "client": network.add_host("client", "198.18.0.2")}
        hosts.update({w: network.add_host(w, f"198.18.0.{20 + i}") for i, w in enumerate(WORKERS, start=1)})
        env = clean_env()
        urls = {c: f"http://{hosts[c].address}:{COORDINATOR_PORT}" for c in ("c1", "c2")}
        procs = {c: network.spawn(hosts[c].namespace, c, coordinator_argv(hosts[c], [
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL), "--worker-token", TOKEN]), env) for c in urls}
        for w in WORKERS:
            procs[w] = network.spawn(hosts[w].namespace, w, worker_argv(hosts[w], w, list(urls.values()), model_path, [
                "--threads", "1", "--max-sessions", "2", "--heartbeat-interval", "0.5", "--worker-token", TOKEN]), env)
        clients = {c: Client(hosts["client"].namespace, url) for c, url in urls.items()}
        pool = TwoCoordinators(network, hosts, clients, procs)
        for c in urls:
            wait_for(lambda c=c: all(pool.states(c).get(w) == "alive" for w in WORKERS), 120,
                     f"every worker alive at {c}", pool)
        yield pool
    finally:
        network.close()
        for client in clients.values():
            client.close()


@pytest.mark.parametrize(("cut", "other"), [("c1", "c2"), ("c2", "c1")])
def test_the_pool_survives_either_coordinator_host_cut_off(pool: TwoCoordinators, cut: str, other: str) -> None:
    served = pool.clients[other].run([SHORT] * 4)
    assert [s.ended for s in served] == ["done"] * 4
    pool.network.partition(pool.hosts[cut])
    try:
        # Longer than the other coordinator waits before calling a worker stale: their beats to it are
        # not held up by the ones to the host that is gone.
        time.sleep(4 * HEARTBEAT_INTERVAL)
        assert pool.states(other) == {w: "alive" for w in WORKERS}
        served = pool.clients[other].run([SHORT] * 4)
        assert [s.ended for s in served] == ["done"] * 4, [(s.status, s.error_body, s.failure) for s in served]
        assert {s.worker_id for s in served} <= set(WORKERS)
    finally:
        pool.network.heal(pool.hosts[cut])
    # Plugged back: the workers' next beats register them there again, and it serves.
    wait_for(lambda: all(pool.states(cut).get(w) == "alive" for w in WORKERS), 30, f"the workers back at {cut}", pool)
    served = pool.clients[cut].run([SHORT] * 4)
    assert [s.ended for s in served] == ["done"] * 4, [(s.status, s.error_body, s.failure) for s in served]
