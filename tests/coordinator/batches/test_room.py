"""Whether the pool has room for one more batch line (coordinator/batches/room.py): a free sequence and
nobody waiting in the queue for the model."""

from __future__ import annotations

import json

import httpx
import pytest

from coordinator.app import create_app
from coordinator.batches.room import room_in
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.state import CoordinatorState
from tests.coordinator import fakes

pytestmark = pytest.mark.anyio
BODY = json.dumps({"model": fakes.MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
CHAT = "/v1/chat/completions"


async def test_room_follows_the_pools_free_sequences_and_its_queue() -> None:
    clock = ManualClock()
    app = create_app(Settings(heartbeat_interval=1.0), clock=clock, worker_client=fakes.FakeWorkers({}).client())
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                   base_url="http://coord") as client:
        state: CoordinatorState = app.state.coordinator
        room = room_in(state)
        assert room(CHAT, BODY, "")  # no worker yet: the line's own request says why
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time(), sessions=4, max_sessions=4))
        assert not room(CHAT, BODY, "")  # every sequence taken
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time(), sessions=1, max_sessions=4))
        assert room(CHAT, BODY, "")
        waiter = state.queue.join(fakes.MODEL, "", 1)  # an interactive request waits for the model
        assert not room(CHAT, BODY, "")
        state.queue.leave(waiter)
        assert room(CHAT, BODY, "")
        assert room(CHAT, json.dumps({"model": "unknown", "messages": []}).encode(), "")
