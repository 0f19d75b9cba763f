"""The prefix peer hint (coordinator/affinity/placement.py `prefix_holder`, coordinator/relay/dispatch.py
`PrefixPeer`): a worker the request goes to that was sent less of its prompt's prefix than another is
told where those cells are; the worker that holds them, or one that was sent as much, is not."""

from __future__ import annotations

import json

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import (
    FakeWorkers,
    done,
    heartbeat,
    refusing,
    register,
    running_app,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio
SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0, scorers="session_load:0.3,kv_load:0.2,prefix:0.5")
PROMPT = "The same long system prompt, block after block. " * 40  # about 8 of the index's 256-char blocks


def first_then_full() -> object:
    """Serves its first request; then its KV is full."""
    calls = []

    def behaviour(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return streaming([token(0, "a"), done(worker_id="w1")], worker_id="w1")(request)
        return refusing(503, "kv_full")(request)
    return behaviour


async def sent_after_w1_filled(prompt: str) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """PROMPT to w1 (w2 is busier); then `prompt`, which w1, full now, refuses and w2 serves: the
    bodies of the generate requests, in order, with the worker each went to."""
    clock = ManualClock()
    fakes = FakeWorkers({"w1": first_then_full(), "w2": streaming([token(0, "b"), done(worker_id="w2")],  # type: ignore[dict-item]
                                                                   worker_id="w2")})
    async with running_app(SETTINGS, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()))).status_code == 200
        assert (await register(client, heartbeat("w2", timestamp=clock.time(), sessions=2))).status_code == 200
        first = await client.post("/coordinator/infer", json={"prompt": PROMPT, "max_tokens": 4})
        assert first.status_code == 200 and first.headers["x-worker-id"] == "w1"
        second = await client.post("/coordinator/infer", json={"prompt": prompt, "max_tokens": 4})
        assert second.status_code == 200 and second.headers["x-worker-id"] == "w2"
    bodies = [(host, json.loads(r.content)) for host, r in fakes.calls if r.url.path == "/worker/generate"]
    assert [host for host, _ in bodies] == ["w1", "w1", "w2"]  # w1 first (it holds the prefix), then full
    assert "prefix_peer" not in bodies[0][1] and "prefix_peer" not in bodies[1][1]
    return bodies


async def test_a_worker_that_lacks_the_prefix_is_told_which_worker_holds_it() -> None:
    bodies = await sent_after_w1_filled(PROMPT)
    assert bodies[2][1]["prefix_peer"] == "http://w1.test" and bodies[2][1]["prompt"] == PROMPT


async def test_no_hint_for_a_prompt_no_worker_was_sent_before() -> None:
    """As above, but the second prompt is another: no worker was sent any of it, so w2 is told of no
    peer. (Before, this test had one worker, so no hint could be given whatever the rule.)"""
    other = "A different prompt altogether, about the weather in the hills. " * 40
    bodies = await sent_after_w1_filled(other)
    assert bodies[2][1]["prompt"] == other and "prefix_peer" not in bodies[2][1]
