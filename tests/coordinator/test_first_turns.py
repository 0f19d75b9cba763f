"""Concurrent first turns on one new session_id end on one worker: one wins, the others get 409.
Before, both were placed, on different workers; the coordinator followed one and the other copy held
a slot and KV until its TTL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, admitted, done, heartbeat, register, running_app, token

pytestmark = pytest.mark.anyio


def slow_start(worker_id: str) -> object:
    def behaviour(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield admitted()
            await asyncio.sleep(0.2)  # prefill: the window in which a second first turn used to slip in
            yield token(0, "hi")
            yield done(worker_id=worker_id)

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body())
    return behaviour


async def test_concurrent_first_turns_of_one_new_session_one_wins_the_rest_get_409() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": slow_start("w1"), "w2": slow_start("w2")})  # type: ignore[dict-item]
    async with running_app(Settings(heartbeat_interval=1.0, queue_size=0), fakes, clock) as client:
        for w in ("w1", "w2"):
            assert (await register(client, heartbeat(w, timestamp=clock.time()))).status_code == 200
        body = {"prompt": "hi", "max_tokens": 3, "session_id": "new-1"}
        answers = await asyncio.gather(*(client.post("/coordinator/infer", json=body) for _ in range(3)))
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200, 409, 409], [a.text for a in answers]
        assert all(a.json()["reason"] == "session_busy" for a in answers if a.status_code == 409)
        assert len(fakes.calls) == 1  # only the winner reached a worker
        # The id is now known: its next turn goes to the same worker.
        winner = next(a for a in answers if a.status_code == 200).headers["x-worker-id"]
        again = await client.post("/coordinator/infer", json=body)
        assert again.status_code == 200 and again.headers["x-worker-id"] == winner
