"""Disaggregated prefill (coordinator/relay/prefill.py, DISAGGREGATE_PROMPT_BYTES): a long new prompt is
first sent as a one-token request to the policy's first worker, then to another worker naming the first
as its `prefix_peer`; a short prompt, a session's turn or a prefill that fails goes as without it."""

from __future__ import annotations

import json

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
SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0, disaggregate_prompt_bytes=1000)
LONG = "A long prompt, prefilled on one worker and decoded on another. " * 20  # 1,280 bytes


def serving(worker_id: str) -> object:
    return streaming([token(0, "a"), token(1, "b"), done(worker_id=worker_id)], worker_id=worker_id)


async def generate_bodies(fakes: FakeWorkers) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    return [(host, json.loads(r.content)) for host, r in fakes.calls if r.url.path == "/worker/generate"]


async def test_a_long_prompt_is_prefilled_on_one_worker_and_decoded_on_the_other() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": serving("w1"), "w2": serving("w2")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=1))  # the policy's second
        answer = await client.post("/coordinator/infer", json={"prompt": LONG, "max_tokens": 8})
        assert answer.status_code == 200 and answer.headers["x-worker-id"] == "w2"
        health = (await client.get("/coordinator/health")).json()
        assert health["requests_running"] == 0  # both reservations released
        metrics = (await client.get("/metrics")).text
        assert 'coordinator_disaggregated_prefills_total{outcome="prefilled"} 1.0' in metrics
        bodies = await generate_bodies(fakes)
        assert [host for host, _ in bodies] == ["w1", "w2"]
        assert bodies[0][1] == {"prompt": LONG, "max_tokens": 1, "token_ids": True}  # the prefill: one token
        assert bodies[1][1]["max_tokens"] == 8 and bodies[1][1]["prefix_peer"] == "http://w1.test"
        # Short, or a session's: one worker, as without the option.
        assert (await client.post("/coordinator/infer", json={"prompt": "Short.", "max_tokens": 8})).status_code == 200
        assert (await client.post("/coordinator/infer", json={"prompt": LONG, "max_tokens": 8,
                                                              "session_id": "s"})).status_code == 200
    later = (await generate_bodies(fakes))[2:]
    assert len(later) == 2 and all("prefix_peer" not in body for _, body in later)


async def test_a_prefill_that_fails_leaves_the_prompt_to_the_worker_that_decodes() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": refusing(503, "kv_full"), "w2": serving("w2")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=1))
        answer = await client.post("/coordinator/infer", json={"prompt": LONG, "max_tokens": 8})
        assert answer.status_code == 200 and answer.headers["x-worker-id"] == "w2"
        assert 'coordinator_disaggregated_prefills_total{outcome="failed"} 1.0' in (await client.get("/metrics")).text
    bodies = await generate_bodies(fakes)
    # The prefill refused on w1; the request then went to w1 again (first by the policy) and on to w2.
    assert [(host, body["max_tokens"]) for host, body in bodies] == [("w1", 1), ("w1", 8), ("w2", 8)]
    assert all("prefix_peer" not in body for _, body in bodies)


async def test_with_one_worker_nothing_is_disaggregated() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": serving("w1")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert (await client.post("/coordinator/infer", json={"prompt": LONG, "max_tokens": 8})).status_code == 200
    assert [(host, body["max_tokens"]) for host, body in await generate_bodies(fakes)] == [("w1", 8)]
