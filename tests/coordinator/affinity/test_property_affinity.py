"""Session affinity through the whole coordinator: a session goes back to its worker only while that
worker serves the model asked for. The policy's own table (scheduling/test_policy.py) checks `select`;
this checks that the gateway hands it the model and the session's worker, so the rule holds end to end."""

from __future__ import annotations

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import (
    MODEL,
    FakeWorkers,
    done,
    heartbeat,
    register,
    running_app,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio


def answering() -> FakeWorkers:
    """Workers a and b, each streaming one token and `done`."""
    return FakeWorkers({w: streaming([token(0), done(worker_id=w)], worker_id=w) for w in ("a", "b")})


async def turn(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 2, "model": MODEL,
                                                          "session_id": "s"})


async def test_a_sessions_worker_that_now_serves_another_model_is_not_chosen() -> None:
    clock, fakes = ManualClock(), answering()
    async with running_app(Settings(heartbeat_interval=1.0, queue_size=0), fakes, clock) as client:
        await register(client, heartbeat("a", timestamp=clock.time()))
        first = await turn(client)
        assert (first.status_code, first.headers["x-worker-id"]) == (200, "a")
        # a restarted with another model (its sessions went with the old one); b serves the model now.
        await register(client, heartbeat("a", timestamp=clock.time(), model="other"))
        await register(client, heartbeat("b", timestamp=clock.time()))
        called = len(fakes.calls)
        again = await turn(client)
        assert (again.status_code, again.json()["reason"]) == (404, "unknown_session"), again.text
        assert fakes.hosts_called()[called:] == []  # a was not asked to continue a conversation it cannot hold
        fresh = await turn(client)  # said once: the id starts afresh, on a worker that serves the model
        assert (fresh.status_code, fresh.headers["x-worker-id"]) == (200, "b")


async def test_a_sessions_worker_that_still_serves_the_model_keeps_it_over_a_less_loaded_one() -> None:
    clock, fakes = ManualClock(), answering()
    async with running_app(Settings(heartbeat_interval=1.0, queue_size=0), fakes, clock) as client:
        await register(client, heartbeat("a", timestamp=clock.time()))
        assert (await turn(client)).headers["x-worker-id"] == "a"
        await register(client, heartbeat("a", timestamp=clock.time(), sessions=3))
        await register(client, heartbeat("b", timestamp=clock.time()))
        again = await turn(client)
        assert (again.status_code, again.headers["x-worker-id"]) == (200, "a")
