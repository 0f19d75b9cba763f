"""The admission queue through the whole app: a request at capacity waits instead of bouncing, is
admitted when capacity frees, in arrival order, and is refused with the queue's own reasons."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import (
    FakeWorkers,
    admitted,
    done,
    heartbeat,
    refusing,
    register,
    running_app,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio
STREAM = [token(0, "Hi"), done()]


def settings(**over: object) -> Settings:
    values: dict[str, object] = {"heartbeat_interval": 1.0, "queue_size": 4, "queue_timeout": 5.0, **over}
    return Settings(**values)  # type: ignore[arg-type]


async def infer(client: httpx.AsyncClient, request_id: str) -> httpx.Response:
    return await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 5}),
                             headers={"x-request-id": request_id})


async def metric(client: httpx.AsyncClient, line_start: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def wait_queued(client: httpx.AsyncClient, n: int, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if await metric(client, "coordinator_queue_length") == n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {n} requests in the queue")


async def wait_called(fakes: FakeWorkers, n: int, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if len(fakes.calls) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the workers were never called {n} times")


async def two_queued(client: httpx.AsyncClient, clock: ManualClock) -> tuple[asyncio.Task[httpx.Response], ...]:
    """w1 full (4 of 4 sessions), then requests "first" and "second" waiting in that order."""
    await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
    first = asyncio.create_task(infer(client, "first"))
    await wait_queued(client, 1)
    second = asyncio.create_task(infer(client, "second"))
    await wait_queued(client, 2)
    return first, second


async def test_a_request_at_capacity_waits_and_is_admitted_when_a_heartbeat_shows_room() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(settings(), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        waiting = asyncio.create_task(infer(client, "q1"))
        await wait_queued(client, 1)
        assert not waiting.done() and fakes.calls == []  # it holds nothing on the worker while it waits
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3))
        response = await waiting
        assert response.status_code == 200 and fakes.hosts_called() == ["w1"]
        assert await metric(client, 'coordinator_queue_outcomes_total{outcome="admitted"}') == 1
        assert await metric(client, "coordinator_queue_length") == 0


async def test_waiters_are_admitted_in_arrival_order_and_none_overtakes_them() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(settings(), fakes, clock) as client:
        first, second = await two_queued(client, clock)
        # Room for all: the head goes first, then hands on to the next.
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=0))
        assert (await first).status_code == 200 and (await second).status_code == 200
        assert [request.headers["x-request-id"] for _, request in fakes.calls] == ["first", "second"]


async def test_a_full_queue_answers_queue_full_at_once() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(settings(queue_size=1), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        waiting = asyncio.create_task(infer(client, "q1"))
        await wait_queued(client, 1)
        refused = await infer(client, "q2")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["reason"] == "queue_full"
        waiting.cancel()
        assert await metric(client, 'coordinator_queue_outcomes_total{outcome="queue_full"}') == 1


async def test_a_wait_past_the_timeout_is_queue_timeout() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(settings(queue_timeout=0.05), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), kv_reserved_bytes=1_000_000))
        response = await infer(client, "late")
        assert (response.status_code, response.json()["reason"]) == (503, "queue_timeout")
        assert await metric(client, "coordinator_queue_length") == 0
        assert await metric(client, 'coordinator_queue_outcomes_total{outcome="queue_timeout"}') == 1
        assert await metric(client, "coordinator_queue_wait_seconds_count") == 1


async def test_requests_that_cannot_be_served_are_never_queued() -> None:
    clock = ManualClock()
    async with running_app(settings(), FakeWorkers(), clock) as client:
        assert (await infer(client, "none")).json()["reason"] == "no_workers"
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        unknown = await client.post("/coordinator/infer", content=json.dumps({"prompt": "x", "model": "gpt-9"}))
        assert unknown.json()["reason"] == "unknown_model"
        assert await metric(client, "coordinator_queue_wait_seconds_count") == 0


def test_refusal_log_rate_limit_allows_bursts_then_counts_what_it_leaves_out() -> None:
    from coordinator.relay.requests import RateLimit

    limit = RateLimit(per_second=5)
    assert [limit.allow(0.0) for _ in range(8)] == [True] * 5 + [False] * 3
    assert limit.left_out == 3
    assert limit.allow(0.2) and not limit.allow(0.2)  # one token back after 0.2 s at 5/s
    assert limit.allow(10.0)


async def test_the_head_hands_on_its_place_once_reserved_not_when_its_worker_answers() -> None:
    """A woken request leaves the queue when its worker's capacity is reserved: the next one is
    dispatched while the first still waits for its first token (prefill), not one prefill after it."""
    clock, first_token = ManualClock(), asyncio.Event()

    def slow_prefill(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield admitted()
            await first_token.wait()
            for chunk in STREAM:
                yield chunk

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body())

    fakes = FakeWorkers({"w1": slow_prefill})
    async with running_app(settings(), fakes, clock) as client:
        first, second = await two_queued(client, clock)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=0))
        await wait_called(fakes, 2)
        assert [request.headers["x-request-id"] for _, request in fakes.calls] == ["first", "second"]
        assert not first.done() and not second.done()  # both dispatched, neither has its first token
        first_token.set()
        assert (await first).status_code == 200 and (await second).status_code == 200


async def test_a_placed_head_that_its_worker_refuses_waits_again_instead_of_failing() -> None:
    clock, refusals = ManualClock(), [refusing(503, "sessions_full")]
    ok = streaming(STREAM)

    def refuse_once(request: httpx.Request) -> httpx.Response:
        return refusals.pop()(request) if refusals else ok(request)

    fakes = FakeWorkers({"w1": refuse_once})
    async with running_app(settings(), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        first = asyncio.create_task(infer(client, "first"))
        await wait_queued(client, 1)
        # Room for one in the coordinator's view: the head leaves the queue when placed, the worker
        # refuses it (its view was newer), and it takes its place at the head again.
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3))
        await wait_called(fakes, 1)
        await wait_queued(client, 1)
        assert not first.done()
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=0))
        assert (await first).status_code == 200
        assert [request.headers["x-request-id"] for _, request in fakes.calls] == ["first", "first"]
        assert await metric(client, "coordinator_queue_length") == 0


async def test_a_worker_that_refused_as_full_is_not_asked_again_before_its_next_heartbeat() -> None:
    """Another coordinator filled the worker: its refusal counts it full here, so the waiting request
    is not sent to it again when one of this coordinator's own streams ends, only once a heartbeat
    shows room; the refusal never reaches the client."""
    clock, finish = ManualClock(), asyncio.Event()

    def held(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield admitted()
            await finish.wait()
            for chunk in STREAM:
                yield chunk

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    script = [held, refusing(503, "sessions_full")]
    ok = streaming(STREAM)
    fakes = FakeWorkers({"w1": lambda request: script.pop(0)(request) if script else ok(request)})
    async with running_app(settings(), fakes, clock) as client:
        # 2 of 4 free here; the 2 streams it lists are not this coordinator's: another one uses it too.
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=2, streams=[900, 901]))
        first = asyncio.create_task(infer(client, "first"))
        await wait_called(fakes, 1)
        second = asyncio.create_task(infer(client, "second"))  # the worker: full (the other coordinator)
        await wait_called(fakes, 2)
        await wait_queued(client, 1)
        finish.set()  # this coordinator's own stream ends: its queue wakes
        assert (await first).status_code == 200
        await asyncio.sleep(0.05)
        assert len(fakes.calls) == 2 and not second.done()  # not asked again: full until it reports
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, streams=[900]))
        assert (await second).status_code == 200
        assert [request.headers["x-request-id"] for _, request in fakes.calls] == ["first", "second", "second"]
