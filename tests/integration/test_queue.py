"""The admission queue with a real coordinator and a real worker: a request at capacity waits and is
served when a slot frees, times out with `queue_timeout`, and leaves the queue when its client does.
A pool of its own (one worker, two sessions) so its capacity is easy to fill."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import start_coordinator, start_worker
from tests.integration.streams import infer
from tests.integration.test_capacity import hold
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
HOLD = {"prompt": "Count.", "max_tokens": 400, "ignore_eos": True}
SMALL = {"prompt": "Hi", "max_tokens": 4}


class Pool:
    def __init__(self, log_dir: Path, model_path: Path) -> None:
        self.coordinator, self.url = start_coordinator(log_dir, "coordinator-q", "--heartbeat-interval", "1",
                                                       "--queue-size", "2", "--queue-timeout", "3")
        self.worker, _ = start_worker(log_dir, "wq", self.url, model_path, "--threads", "1", "--max-sessions", "2",
                                      "--session-max-tokens", "512", "--heartbeat-interval", "0.5")
        wait_until(lambda: httpx.get(self.url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 1,
                   60, "the worker to register")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=2).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def idle(self) -> None:
        wait_until(lambda: httpx.get(self.url + "/coordinator/health", timeout=2).json()["requests_running"] == 0
                   and self.metric("coordinator_queue_length") == 0, 30, "the pool to be idle")


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    running = Pool(tmp_path_factory.mktemp("queue"), model_path)
    try:
        yield running
    finally:
        running.worker.stop()
        running.coordinator.stop()


async def holding(client: httpx.AsyncClient, pool: Pool, n: int) -> tuple[list[asyncio.Task], asyncio.Event]:  # type: ignore[type-arg]
    release, opened = asyncio.Event(), asyncio.Queue()  # type: ignore[var-annotated]
    holders = [asyncio.create_task(hold(client, pool.url, HOLD, opened, release)) for _ in range(n)]
    for _ in range(n):
        await asyncio.wait_for(opened.get(), timeout=60)
    return holders, release


async def test_a_request_at_capacity_waits_and_is_served_when_a_slot_frees(pool: Pool) -> None:
    pool.idle()
    async with httpx.AsyncClient(timeout=60) as client:
        holders, release = await holding(client, pool, 2)
        waiting = asyncio.create_task(infer(client, pool.url, SMALL))
        await asyncio.to_thread(wait_until, lambda: pool.metric("coordinator_queue_length") == 1, 5,
                                "the request to queue")
        assert not waiting.done()
        release.set()  # the holders hang up: their slots free, the waiting request goes in
        served = await asyncio.wait_for(waiting, timeout=30)
        await asyncio.gather(*holders, return_exceptions=True)
    assert served.status == 200 and served.names[-1] == "done"
    assert pool.metric('coordinator_queue_outcomes_total{outcome="admitted"}') >= 1


async def test_a_wait_past_the_queue_timeout_is_503_queue_timeout(pool: Pool) -> None:
    pool.idle()
    async with httpx.AsyncClient(timeout=60) as client:
        holders, release = await holding(client, pool, 2)
        try:
            late = await infer(client, pool.url, SMALL)
        finally:
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)
    assert late.status == 503 and late.body is not None and late.body["reason"] == "queue_timeout"
    assert late.headers["retry-after"] == "1"


async def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once(pool: Pool) -> None:
    pool.idle()
    gone_before = pool.metric('coordinator_queue_outcomes_total{outcome="client_gone"}')
    async with httpx.AsyncClient(timeout=60) as client:
        holders, release = await holding(client, pool, 2)
        try:
            leaving = asyncio.create_task(infer(client, pool.url, SMALL))
            await asyncio.to_thread(wait_until, lambda: pool.metric("coordinator_queue_length") == 1, 5,
                                    "the request to queue")
            leaving.cancel()  # closes its connection
            await asyncio.gather(leaving, return_exceptions=True)
            await asyncio.to_thread(wait_until, lambda: pool.metric("coordinator_queue_length") == 0, 1,
                                    "the queue to be left at once")
            assert pool.metric('coordinator_queue_outcomes_total{outcome="client_gone"}') == gone_before + 1
        finally:
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)
