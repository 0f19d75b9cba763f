"""Readiness: a coordinator is ready (and joins a shared port) only once it knows the pool, and never
while it drains."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.pool.readiness import SETTLE, Readiness
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token


def readiness(clock: ManualClock, workers: list[int], join_wait: float = 10.0) -> Readiness:
    return Readiness(clock=clock, join_wait=join_wait, workers=lambda: workers[0])


@pytest.mark.parametrize(("waited", "workers", "pool", "status"), [
    (0.0, 0, 0, "joining"),
    (0.0, 2, 2, "joining"),           # heard at once: at a first start the rest get SETTLE to beat too
    (SETTLE - 0.01, 1, 0, "joining"),
    (SETTLE, 1, 0, "ready"),          # a pool's first start: nobody counts more than it has heard
    (SETTLE, 0, 0, "joining"),        # nothing heard yet
    (SETTLE, 1, 2, "joining"),        # a restart: the workers say their coordinators count two
    (SETTLE, 2, 2, "ready"),
    (5.0, 2, 3, "joining"),
    (9.99, 0, 0, "joining"),
    (10.0, 0, 0, "ready"),            # join_wait, a round: a pool with no worker is one it knows
    (10.0, 1, 3, "ready"),            # and the third worker did not beat within it: gone
])
def test_ready_once_it_has_as_many_workers_as_the_pool_counts_or_after_a_round(
        waited: float, workers: int, pool: int, status: str) -> None:
    clock = ManualClock()
    ready = readiness(clock, [workers])
    ready.heard(pool)
    clock.advance(waited)
    assert ready.status(draining=False) == status


def test_the_pool_count_is_the_most_any_heartbeat_said() -> None:
    clock, count = ManualClock(), [2]
    ready = readiness(clock, count)
    clock.advance(SETTLE)
    ready.heard(3)
    ready.heard(1)  # a worker whose coordinators knew fewer (one just restarted too)
    assert not ready.known()
    count[0] = 3
    assert ready.known()


def test_once_known_it_stays_known_and_draining_is_never_ready() -> None:
    clock, count = ManualClock(), [1]
    ready = readiness(clock, count)
    clock.advance(SETTLE)
    assert ready.known()
    count[0] = 0  # every worker gone: `no_workers`, not a reason to leave the port
    assert ready.status(draining=False) == "ready"
    assert ready.status(draining=True) == "draining"


def test_until_known_returns_when_a_heartbeat_is_heard_not_at_its_next_tick() -> None:
    clock, count = ManualClock(), [0]
    ready = readiness(clock, count)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        waiting = asyncio.create_task(ready.until_known())
        await asyncio.sleep(0.01)
        clock.advance(SETTLE)
        await asyncio.sleep(SETTLE / 2)  # past SETTLE on this clock, but no worker: still waiting
        assert not waiting.done()
        count[0] = 1
        heard = loop.time()
        ready.heard(1)
        await asyncio.wait_for(waiting, 1)
        return loop.time() - heard

    assert asyncio.run(run()) < SETTLE / 8


STREAM = [token(0, "hi"), done()]


@pytest.mark.anyio
async def test_the_ready_endpoint_answers_503_joining_until_the_pool_is_known() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(Settings(heartbeat_interval=1.0), fakes, clock) as client:
        joining = await client.get("/coordinator/ready")
        assert joining.status_code == 503 and joining.json() == {"status": "joining", "workers": 0}
        assert (await client.get("/coordinator/health")).status_code == 200  # alive all the same
        ack = await register(client, heartbeat("w1", timestamp=clock.time()))
        assert ack.status_code == 200 and ack.json()["workers"] == 1  # what the worker passes on
        assert (await client.get("/coordinator/ready")).status_code == 503
        clock.advance(SETTLE)
        ready = await client.get("/coordinator/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "workers": 1}
        transport = client._transport
        assert isinstance(transport, httpx.ASGITransport)
        transport.app.state.coordinator.draining = True  # type: ignore[attr-defined]
        draining = await client.get("/coordinator/ready")
        assert draining.status_code == 503 and draining.json()["status"] == "draining"


def test_a_process_that_joins_a_shared_port_is_ready_only_once_it_has_joined() -> None:
    clock = ManualClock()
    ready = Readiness(clock=clock, join_wait=10.0, workers=lambda: 1, gated=True)
    clock.advance(SETTLE)
    assert ready.known() and ready.status(draining=False) == "joining"
    ready.joined()
    assert ready.status(draining=False) == "ready"
