"""Fair shares through the whole app: where requests wait, the tenant that was served least (in
weighted tokens, charged as they are relayed) goes next; each tenant's tokens, waits and refusals
show in /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, admitted, done, heartbeat, register, running_app, token
from tests.coordinator.test_gateway_queue import metric, wait_queued

pytestmark = pytest.mark.anyio
KEYS = "heavy-key heavy,light-key light"


def gated(gate: asyncio.Event, gated_ids: set[str]):  # type: ignore[no-untyped-def]
    """A worker whose streams for `gated_ids` send one token, wait for `gate`, then three more; the
    others send one token and end."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        request_id = request.headers.get("x-request-id", "")

        async def body() -> AsyncIterator[bytes]:
            yield admitted(5)
            yield token(0)
            if request_id in gated_ids:
                await gate.wait()
                for i in range(1, 4):
                    yield token(i)
            yield done(n=4 if request_id in gated_ids else 1)

        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-worker-id": "w1",
                                            "x-request-id": request_id}, content=body())

    return behaviour


async def infer(client: httpx.AsyncClient, request_id: str, key: str) -> httpx.Response:
    return await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 5}),
                             headers={"x-request-id": request_id, "authorization": f"Bearer {key}"})


async def started(fakes: FakeWorkers, n: int) -> None:
    for _ in range(400):
        if len(fakes.calls) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {n} requests sent to the worker")


@pytest.mark.parametrize("fair_share", [True, False])
async def test_a_light_tenant_goes_before_a_heavy_one_that_queued_first(fair_share: bool) -> None:
    clock, gate = ManualClock(), asyncio.Event()
    fakes = FakeWorkers({"w1": gated(gate, {"running"})})
    settings = Settings(heartbeat_interval=1.0, queue_size=4, queue_timeout=5.0, api_keys=KEYS, open_metrics=True,
                        fair_share=fair_share)
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3))  # one of 4 free
        running = asyncio.create_task(infer(client, "running", "heavy-key"))
        await started(fakes, 1)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        heavy = [asyncio.create_task(infer(client, f"heavy-{i}", "heavy-key")) for i in range(2)]
        await wait_queued(client, 2)
        light = asyncio.create_task(infer(client, "light", "light-key"))
        await wait_queued(client, 3)
        # The light tenant returns from idle: lifted to the heavy one's counter, not below it. Then the
        # heavy tenant's running stream makes three more tokens, charged as they are relayed.
        gate.set()
        assert (await running).status_code == 200
        ack = await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3))  # room for one
        # The answer tells the worker who waits for its model here, which it passes on to every coordinator.
        expected = ["t:heavy", "t:light"] if fair_share else []  # without fair shares, one line of no tenant
        assert sorted(ack.json()["waiting"]) == expected
        await started(fakes, 2)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=0))
        for task in [*heavy, light]:
            assert (await task).status_code == 200
        order = [request.headers["x-request-id"] for _, request in fakes.calls]
        assert order[:2] == (["running", "light"] if fair_share else ["running", "heavy-0"]), order
        assert await metric(client, 'coordinator_tenant_tokens_total{kind="generated",tenant="t:heavy"}') == 6
        assert await metric(client, 'coordinator_tenant_tokens_total{kind="prompt",tenant="t:light"}') == 5
        assert await metric(client, 'coordinator_tenant_queue_wait_seconds_count{tenant="t:light"}') == 1


async def test_a_refusal_is_counted_for_its_tenant() -> None:
    clock, fakes = ManualClock(), FakeWorkers({})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, api_keys=KEYS, open_metrics=True)
    async with running_app(settings, fakes, clock) as client:
        response = await infer(client, "r", "light-key")  # no worker at all
        assert response.status_code == 503
        reason = response.json()["reason"]
        assert await metric(client, f'coordinator_tenant_refusals_total{{reason="{reason}",tenant="t:light"}}') == 1


async def test_a_key_over_its_limit_gets_429_with_its_headers_and_the_other_key_is_served() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": gated(asyncio.Event(), set())})
    settings = Settings(heartbeat_interval=1.0, api_keys="heavy-key heavy 1 rpm=2,light-key light",
                        open_metrics=True)
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        for i in range(2):
            assert (await infer(client, f"h{i}", "heavy-key")).status_code == 200
        refused = await infer(client, "h2", "heavy-key")
        assert refused.status_code == 429 and refused.json()["reason"] == "rate_limited"
        assert refused.headers["retry-after"] == "30" and refused.headers["x-ratelimit-limit-requests"] == "2"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        openai = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                                   headers={"authorization": "Bearer heavy-key"})
        assert openai.status_code == 429 and openai.json()["error"]["code"] == "rate_limited"
        assert (await infer(client, "l0", "light-key")).status_code == 200
        assert await metric(client, 'coordinator_tenant_refusals_total{reason="rate_limited",tenant="t:heavy"}') == 2
        clock.advance(30)
        await register(client, heartbeat("w1", timestamp=clock.time()))  # still alive after those 30 s
        assert (await infer(client, "h3", "heavy-key")).status_code == 200


async def test_an_interactive_request_goes_before_batch_requests_that_waited_first() -> None:
    clock, gate = ManualClock(), asyncio.Event()
    fakes = FakeWorkers({"w1": gated(gate, set())})
    settings = Settings(heartbeat_interval=1.0, queue_size=4, queue_timeout=5.0, open_metrics=True,
                        api_keys="jobs-key jobs 1 priority=batch,app-key app")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))  # full
        batch = [asyncio.create_task(infer(client, f"batch-{i}", "jobs-key")) for i in range(2)]
        await wait_queued(client, 2)
        urgent = asyncio.create_task(client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "service_tier": "priority"},
            headers={"authorization": "Bearer app-key", "x-request-id": "urgent"}))
        await wait_queued(client, 3)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3))  # room for one
        await started(fakes, 1)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=0))
        assert (await urgent).status_code == 200
        for task in batch:
            assert (await task).status_code == 200
        order = [request.headers["x-request-id"] for _, request in fakes.calls]
        assert order == ["urgent", "batch-0", "batch-1"], order


@pytest.mark.parametrize(("headers", "body", "message"), [
    ({"x-priority": "urgent"}, {}, "priority: 'urgent' is not a priority class"),
    ({}, {"priority": "interactive"}, "priority: 'interactive' is above this key's highest class 'batch'"),
    ({"x-priority": "interactive"}, {}, "priority: 'interactive' is above this key's highest class 'batch'"),
])
async def test_a_class_the_key_may_not_ask_for_is_400_naming_it(headers: dict[str, str], body: dict[str, str],
                                                              message: str) -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": gated(asyncio.Event(), set())})
    settings = Settings(heartbeat_interval=1.0, api_keys="jobs-key jobs 1 priority=batch max_priority=batch")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        refused = await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5, **body},
                                    headers={"authorization": "Bearer jobs-key", **headers})
        assert refused.status_code == 400 and refused.json()["error"].startswith(message)
        openai = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "service_tier": "priority"},
            headers={"authorization": "Bearer jobs-key"})
        assert openai.status_code == 400 and openai.json()["error"]["param"] == "priority"
        assert fakes.calls == []


async def test_a_worker_is_told_of_batch_requests_and_gets_an_interactive_one_when_full_if_it_can_park() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": gated(asyncio.Event(), set())})
    settings = Settings(heartbeat_interval=1.0, queue_size=4, queue_timeout=0.2,
                        api_keys="jobs-key jobs 1 priority=batch,app-key app")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert (await infer(client, "batch", "jobs-key")).status_code == 200
        assert (await infer(client, "app", "app-key")).status_code == 200
        sent = {request.headers["x-request-id"]: json.loads(request.content) for _, request in fakes.calls}
        assert sent["batch"]["priority"] == "batch" and "priority" not in sent["app"]  # interactive: the default
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4, parkable=1))  # full
        assert (await infer(client, "urgent", "app-key")).status_code == 200  # the worker parks a batch request
        refused = await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5},
                                    headers={"authorization": "Bearer jobs-key", "x-request-id": "more"})
        assert refused.status_code == 503  # a batch request waits for a free sequence, whatever can be parked
        assert "more" not in {request.headers["x-request-id"] for _, request in fakes.calls}


async def test_a_tenants_weight_goes_to_the_worker_whose_line_applies_it() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": gated(asyncio.Event(), set())})
    settings = Settings(heartbeat_interval=1.0, api_keys="big-key big 3,small-key small")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert (await infer(client, "r-big", "big-key")).status_code == 200
        assert (await infer(client, "r-small", "small-key")).status_code == 200
    sent = [json.loads(request.content) for _, request in fakes.calls]
    assert sent[0]["tenant_weight"] == 3.0
    assert "tenant_weight" not in sent[1]  # weight 1, the worker's default: not sent
    assert sent[0]["fair_share"] is sent[1]["fair_share"] is True  # the worker keeps headroom too
