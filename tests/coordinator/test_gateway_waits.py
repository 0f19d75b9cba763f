"""The one way to wait, through the whole app: a request for a model being loaded or swapped waits in
the queue's line for that model (counted by its metrics, bounded by its size and deadline, in its
class and fair order) and is woken by the heartbeat that shows the model served; nothing polls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.pool.loads import BUSY_AGAIN
from coordinator.settings import Settings
from protocol.health import OfferedModel
from tests.coordinator import fakes

pytestmark = pytest.mark.anyio
STREAM = [fakes.token(0, "Hi"), fakes.done()]
SMOL, GEMMA = OfferedModel(name="smol", state="loaded"), OfferedModel(name="gemma", state="offered")


def settings(**over: object) -> Settings:
    values: dict[str, object] = {"heartbeat_interval": 1.0, "queue_size": 4, "queue_timeout": 5.0, **over}
    return Settings(**values)  # type: ignore[arg-type]


def worker(loads: list[str]) -> fakes.FakeWorkers:
    """w1: answers a load with 202 (noting it in `loads`) and streams every generation."""
    stream = fakes.streaming(STREAM)

    def behaviour(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/worker/models/load":
            loads.append(json.loads(request.content)["model"])
            return httpx.Response(202, json={"model": "gemma", "state": "loading"})
        return stream(request)

    return fakes.FakeWorkers({"w1": behaviour})


async def beat(client: httpx.AsyncClient, clock: ManualClock, model: str, *offered: OfferedModel,
               **load: Any) -> None:
    hb = fakes.heartbeat("w1", timestamp=clock.time(), model=model, **load).model_copy(update={"offered": list(offered)})
    assert (await fakes.register(client, hb)).status_code == 200


async def infer(client: httpx.AsyncClient, request_id: str, model: str = "gemma") -> httpx.Response:
    return await client.post("/coordinator/infer", headers={"x-request-id": request_id},
                             content=json.dumps({"prompt": "hi", "max_tokens": 5, "model": model}))


async def metric(client: httpx.AsyncClient, line_start: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def until_queued(client: httpx.AsyncClient, n: int) -> None:
    for _ in range(400):
        if await metric(client, "coordinator_queue_length") == n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {n} requests in the queue")


async def test_a_burst_for_a_model_to_load_waits_in_the_queue_and_a_heartbeat_lets_it_in() -> None:
    clock, loads = ManualClock(), list[str]()
    pool = worker(loads)
    async with fakes.running_app(settings(), pool, clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        burst = [asyncio.create_task(infer(client, f"r{i}")) for i in range(3)]
        await until_queued(client, 3)  # every waiter is counted, in the queue's line for gemma
        assert loads == ["gemma"] and not any(t.done() for t in burst)  # one ask for the burst
        await beat(client, clock, "gemma", SMOL.model_copy(update={"state": "offered"}),
                   GEMMA.model_copy(update={"state": "loaded"}))
        answers = await asyncio.wait_for(asyncio.gather(*burst), 2)  # the heartbeat woke them: no poll
        assert [a.status_code for a in answers] == [200, 200, 200] and loads == ["gemma"]
        assert await metric(client, 'coordinator_queue_outcomes_total{outcome="admitted"}') == 3
        assert await metric(client, "coordinator_queue_length") == 0


async def test_the_wait_for_a_load_is_bounded_by_the_queues_size_and_deadline() -> None:
    clock, loads = ManualClock(), list[str]()
    async with fakes.running_app(settings(queue_size=1, queue_timeout=0.3), worker(loads), clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        first = asyncio.create_task(infer(client, "first"))
        await until_queued(client, 1)
        full = await infer(client, "second")
        late = await first
    assert (full.status_code, full.json()["reason"]) == (503, "queue_full")
    assert (late.status_code, late.json()["reason"]) == (503, "queue_timeout")
    assert "loading" in late.json()["error"]  # the timeout says what it waited for


async def test_without_the_queue_a_request_for_a_model_to_load_asks_and_is_told_to_come_back() -> None:
    clock, loads = ManualClock(), list[str]()
    async with fakes.running_app(settings(queue_size=0), worker(loads), clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        refused = await infer(client, "r1")
    assert (refused.status_code, refused.json()["reason"]) == (503, "loading") and refused.headers["retry-after"]
    assert loads == ["gemma"]


async def test_a_request_refused_for_a_swap_waits_for_the_heartbeat_that_ends_it() -> None:
    """The worker began a swap (to gemma, say) after its last heartbeat: it refuses `model_swapping`;
    the request waits in smol's line, and the heartbeat that shows smol served again lets it in."""
    clock = ManualClock()
    swapping, stream = fakes.refusing(503, "model_swapping"), fakes.streaming(STREAM)
    answers = [swapping, stream]
    pool = fakes.FakeWorkers({"w1": lambda request: answers.pop(0)(request)})
    async with fakes.running_app(settings(), pool, clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        waiting = asyncio.create_task(infer(client, "r1", model="smol"))
        await until_queued(client, 1)
        assert len(pool.calls) == 1 and not waiting.done()
        await beat(client, clock, "smol", SMOL, GEMMA)
        answer = await asyncio.wait_for(waiting, 2)
    assert answer.status_code == 200 and len(pool.calls) == 2


async def test_a_higher_class_waiting_for_a_load_goes_first() -> None:
    clock, loads = ManualClock(), list[str]()
    pool = worker(loads)
    async with fakes.running_app(settings(), pool, clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        batch = asyncio.create_task(client.post("/coordinator/infer", headers={"x-request-id": "batch",
                                                                               "x-priority": "batch"},
                                                content=json.dumps({"prompt": "hi", "max_tokens": 5,
                                                                    "model": "gemma"})))
        await until_queued(client, 1)
        interactive = asyncio.create_task(infer(client, "interactive"))
        await until_queued(client, 2)
        await beat(client, clock, "gemma", GEMMA.model_copy(update={"state": "loaded"}),
                   sessions=3, max_sessions=4)  # room for one at a time
        assert (await asyncio.wait_for(interactive, 2)).status_code == 200
        await beat(client, clock, "gemma", GEMMA.model_copy(update={"state": "loaded"}))
        assert (await asyncio.wait_for(batch, 2)).status_code == 200
    generated = [r.headers["x-request-id"] for _, r in pool.calls if r.url.path == "/worker/generate"]
    assert generated == ["interactive", "batch"]


async def test_a_heartbeat_wakes_the_requests_waiting_for_a_model_its_worker_offers() -> None:
    """The worker, busy, refused the ask: the waiter asks again after BUSY_AGAIN, when a heartbeat of that
    worker (which serves another model, and offers this one) wakes it."""
    clock, asks = ManualClock(), list[str]()
    stream = fakes.streaming(STREAM)

    def behaviour(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/worker/models/load":
            asks.append("gemma")
            if len(asks) == 1:
                return httpx.Response(503, json={"error": "swapping", "reason": "model_swapping", "request_id": "x"})
            return httpx.Response(202, json={"model": "gemma", "state": "loading"})
        return stream(request)

    async with fakes.running_app(settings(), fakes.FakeWorkers({"w1": behaviour}), clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        waiting = asyncio.create_task(infer(client, "r1"))
        await until_queued(client, 1)
        assert asks == ["gemma"]
        clock.advance(BUSY_AGAIN)
        await beat(client, clock, "smol", SMOL, GEMMA)
        for _ in range(200):
            if len(asks) == 2:
                break
            await asyncio.sleep(0.005)
        assert asks == ["gemma", "gemma"] and not waiting.done()
        await beat(client, clock, "gemma", GEMMA.model_copy(update={"state": "loaded"}))
        assert (await asyncio.wait_for(waiting, 2)).status_code == 200


async def test_a_model_served_then_swapped_away_is_asked_for_again() -> None:
    """The heartbeat that shows the model served answers the ask (the requests it lets in never ask
    again), so a request after the model was swapped away asks anew instead of waiting ASK_AGAIN."""
    clock, loads = ManualClock(), list[str]()
    async with fakes.running_app(settings(), worker(loads), clock) as client:
        await beat(client, clock, "smol", SMOL, GEMMA)
        first = asyncio.create_task(infer(client, "r1"))
        await until_queued(client, 1)
        await beat(client, clock, "gemma", GEMMA.model_copy(update={"state": "loaded"}), SMOL)
        assert (await asyncio.wait_for(first, 2)).status_code == 200
        await beat(client, clock, "smol", SMOL, GEMMA)  # swapped back (asked by another coordinator, say)
        second = asyncio.create_task(infer(client, "r2"))
        await until_queued(client, 1)
        assert loads == ["gemma", "gemma"]
        second.cancel()
