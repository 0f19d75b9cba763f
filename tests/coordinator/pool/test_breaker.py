"""Circuit breakers: alone (trip, grow, probe, close), and through the app with a worker answering 500."""

from __future__ import annotations

import json

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.pool.breaker import Breakers
from coordinator.pool.registry import Registry
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token


def breakers() -> tuple[Breakers, Registry, ManualClock, list[str]]:
    clock, changes = ManualClock(), []
    reg = Registry(stale_after=30, dead_after=60)
    reg.upsert(heartbeat("w", timestamp=clock.time()), clock.monotonic())
    return (Breakers(reg, clock.monotonic, threshold=3, cooldown=2.0, max_cooldown=5.0, on_change=changes.append),
            reg, clock, changes)


def test_it_opens_after_the_threshold_in_a_row_and_a_success_resets_the_count() -> None:
    b, reg, clock, changes = breakers()
    w = reg.get("w")
    assert w is not None
    b.failed("w"), b.failed("w"), b.succeeded("w"), b.failed("w"), b.failed("w")
    assert w.breaker_open_until == 0.0 and changes == []  # never 3 in a row
    b.failed("w")
    assert w.breaker_open_until == clock.monotonic() + 2.0 and changes == ["open"]


def test_one_probe_after_the_cool_down_and_a_failed_probe_doubles_it_up_to_the_cap() -> None:
    b, reg, clock, changes = breakers()
    w = reg.get("w")
    assert w is not None
    for _ in range(3):
        b.failed("w")
    clock.advance(1.0)
    b.attempt(w)
    assert not w.breaker_probing  # still cooling down: not a probe (the filter keeps it out anyway)
    clock.advance(1.0)
    b.attempt(w)
    assert w.breaker_probing
    b.failed("w")  # the probe failed: open again, twice as long
    assert (w.breaker_probing, w.breaker_open_until) == (False, clock.monotonic() + 4.0)
    clock.advance(4.0)
    b.attempt(w)
    b.failed("w")
    assert w.breaker_open_until == clock.monotonic() + 5.0  # capped
    clock.advance(5.0)
    b.attempt(w)
    b.settled("w")  # the probe's client left: no verdict, the next request may probe
    assert not w.breaker_probing and w.breaker_trips == 3
    b.attempt(w)
    b.succeeded("w")
    assert (w.breaker_open_until, w.breaker_trips, w.breaker_failures) == (0.0, 0, 0)
    assert changes == ["open", "open", "open", "closed"]


@pytest.mark.anyio
async def test_a_worker_answering_500_leaves_scheduling_and_a_probe_brings_it_back() -> None:
    clock = ManualClock()
    state = {"broken": True}

    def flaky(request: httpx.Request) -> httpx.Response:
        if state["broken"]:
            return httpx.Response(500, json={"error": "boom", "reason": "internal", "request_id": "x"})
        return streaming([token(0), done(worker_id="a")], worker_id="a")(request)

    fakes = FakeWorkers({"a": flaky, "b": streaming([token(0), done(worker_id="b")], worker_id="b")})
    settings = Settings(heartbeat_interval=1.0, breaker_failures=2, breaker_cooldown=5.0, queue_size=0)
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("a", timestamp=clock.time()))
        await register(client, heartbeat("b", timestamp=clock.time(), sessions=1))  # a scores better

        async def infer() -> httpx.Response:
            return await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 2}))

        for _ in range(2):  # each fails over to b: the client never sees a's 500
            assert (await infer()).headers["x-worker-id"] == "b"
        assert fakes.hosts_called() == ["a", "b", "a", "b"]
        listing = {w["worker_id"]: w for w in (await client.get("/coordinator/health/workers")).json()["workers"]}
        assert listing["a"]["breaker"] == "open"
        before = len(fakes.calls)
        assert (await infer()).headers["x-worker-id"] == "b"
        assert fakes.hosts_called()[before:] == ["b"]  # a is not even tried while its breaker is open
        metrics = (await client.get("/metrics")).text
        assert 'coordinator_breaker_transitions_total{to="open"} 1.0' in metrics
        assert "coordinator_breakers_open 1.0" in metrics
        state["broken"] = False
        clock.advance(5.0)
        for beat in ("a", "b"):  # keep both alive across the cool-down
            await register(client, heartbeat(beat, timestamp=clock.time(), sessions=int(beat == "b")))
        probe = await infer()
        assert probe.headers["x-worker-id"] == "a"
        listing = {w["worker_id"]: w for w in (await client.get("/coordinator/health/workers")).json()["workers"]}
        assert listing["a"]["breaker"] == "closed"


@pytest.mark.anyio
async def test_a_worker_whose_port_refuses_connections_leaves_the_pool_at_once_until_it_beats_again() -> None:
    """Issue 33: a worker that exited stayed `alive` until its heartbeats were missed (7 s), and every
    request ranked it first paid a failover meanwhile. A refused connection is certain at once."""
    clock = ManualClock()
    fakes = FakeWorkers({"a": streaming([token(0), done(worker_id="a")], worker_id="a"),
                         "b": streaming([token(0), done(worker_id="b")], worker_id="b")})
    settings = Settings(heartbeat_interval=1.0, breaker_failures=3, queue_size=0)
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("a", timestamp=clock.time()))
        await register(client, heartbeat("b", timestamp=clock.time(), sessions=1))  # a scores better

        async def infer() -> httpx.Response:
            return await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 2}))

        async def states() -> dict[str, str]:
            listing = (await client.get("/coordinator/health/workers")).json()["workers"]
            return {w["worker_id"]: w["state"] for w in listing}

        fakes.gone.add("a")
        assert (await infer()).headers["x-worker-id"] == "b"
        assert await states() == {"a": "stale", "b": "alive"}  # one refusal, though the breaker needs 3 failures
        before = len(fakes.calls)
        assert (await infer()).headers["x-worker-id"] == "b"
        assert fakes.hosts_called()[before:] == ["b"]
        fakes.gone.clear()  # restarted: its next heartbeat brings it back
        await register(client, heartbeat("a", timestamp=clock.time()))
        assert (await infer()).headers["x-worker-id"] == "a"
