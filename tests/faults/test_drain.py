"""SIGTERM drains, on both services: no stream is lost without an `error` event, new work goes
elsewhere (worker) or gets 503 `draining` (coordinator), and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest

from tests.faults.conftest import since
from tests.faults.pool import COORDINATOR_DRAIN, WORKER_DRAIN, FaultPool
from tests.integration.streams import Timed, infer, read_events
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
LONG = {"prompt": "Count to a thousand.", "max_tokens": 480, "ignore_eos": True}


async def open_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[Timed, asyncio.Task[None]]:
    """Starts a stream and returns once its first token arrived; the task reads the rest."""
    timed = Timed(0, {})
    opened = asyncio.get_running_loop().create_future()

    async def run() -> None:
        async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
            timed.status, timed.headers = response.status_code, dict(response.headers)
            if response.status_code != 200:
                opened.set_result(None)
                return
            reading = asyncio.create_task(read_events(response, timed))
            while "token" not in timed.names and not reading.done():
                await asyncio.sleep(0.01)
            opened.set_result(None)
            await reading

    task = asyncio.create_task(run())
    await asyncio.wait_for(opened, timeout=60)
    assert timed.status == 200, timed
    return timed, task


async def test_worker_sigterm_moves_its_stream_and_is_unscheduled_at_once(
        fault_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        long, reading = await open_stream(client, fault_pool.url, LONG)
        victim = long.headers["x-worker-id"]
        other = next(w for w in fault_pool.workers if w != victim)
        started = time.monotonic()
        fault_pool.workers[victim].signal(signal.SIGTERM)
        # Its health says so at once, and so does the coordinator's view (a heartbeat sent right away).
        wait_until(lambda: fault_pool.worker_health(victim).status_code == 503, 2, "the worker's health: draining")
        wait_until(lambda: fault_pool.listing()[victim]["draining"], 2, "the coordinator to see it draining")
        unscheduled = since(started)
        for _ in range(3):
            short = await infer(client, fault_pool.url, {"prompt": "Hi", "max_tokens": 4})
            assert short.status == 200 and short.headers["x-worker-id"] == other and short.names[-1] == "done"
        proc = fault_pool.workers[victim].popen
        assert proc is not None
        # The stream moved to the other worker (which had room), so the drain does not wait for it.
        assert await asyncio.to_thread(proc.wait, WORKER_DRAIN + 10) == 0
        exited = since(started)
        await asyncio.wait_for(reading, timeout=60)
    assert long.names[-1] == "done", long.events[-1]
    done = long.events[-1][1]
    assert (done["finish_reason"], done["worker_id"]) == ("length", other)
    # No token twice and none missing across the move: the indices run 0, 1, ... to the last one counted.
    indices = [d["index"] for n, d in long.events if n == "token"]
    assert indices == sorted(set(indices)) and indices[-1] == done["usage"]["completion_tokens"] - 1
    # Moved, not cut at the drain's deadline (whose `draining` error a continuation would also mend): the
    # coordinator counted the move. The exit time is a figure, not a bound (CI shares its cores).
    async with httpx.AsyncClient(timeout=5) as client:
        moves = (await client.get(fault_pool.url + "/metrics")).text
    assert any(line.startswith('coordinator_stream_moves_total{outcome="moved"}') and float(line.split()[-1]) >= 1
               for line in moves.splitlines()), [line for line in moves.splitlines() if "stream_moves" in line]
    figures.append({"case": "worker SIGTERM drain", "unscheduled_s": unscheduled, "exited_s": exited,
                    "drain_timeout_s": WORKER_DRAIN, "exit_code": proc.returncode, "stream": "moved, whole"})


async def test_coordinator_sigterm_refuses_new_work_finishes_short_streams_and_ends_long_ones(
        fault_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    assert fault_pool.coordinator is not None
    async with httpx.AsyncClient(timeout=60) as client:
        long, long_reading = await open_stream(client, fault_pool.url, LONG)
        short, short_reading = await open_stream(client, fault_pool.url, {"prompt": "Hi", "max_tokens": 24,
                                                                         "ignore_eos": True})
        started = time.monotonic()
        fault_pool.coordinator.signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(fault_pool.url + "/coordinator/health", timeout=2).status_code == 503, 2,
                   "the coordinator's health: draining")
        assert (await client.get(fault_pool.url + "/coordinator/health")).json()["status"] == "draining"
        refused = await infer(client, fault_pool.url, {"prompt": "Hi", "max_tokens": 2})
        assert refused.status == 503 and refused.body is not None and refused.body["reason"] == "draining"
        assert refused.headers.get("retry-after") == "1"
        await asyncio.wait_for(short_reading, timeout=COORDINATOR_DRAIN + 10)
        await asyncio.wait_for(long_reading, timeout=COORDINATOR_DRAIN + 10)
        ended = since(started)
    assert short.names[-1] == "done" and short.names.count("token") >= 1
    assert long.names[-1] == "error" and long.events[-1][1]["reason"] == "draining", long.events[-1]
    assert COORDINATOR_DRAIN - 0.2 <= ended <= COORDINATOR_DRAIN + 3
    proc = fault_pool.coordinator.popen
    assert proc is not None and proc.wait(timeout=10) == 0
    # The ended stream's worker request was closed: every worker is idle again.
    for worker_id in fault_pool.workers:
        wait_until(lambda w=worker_id: fault_pool.worker_health(w).json()["load"]["active_streams"] == 0, 10,
                   f"{worker_id} idle after the coordinator's drain")
    figures.append({"case": "coordinator SIGTERM drain", "stream_error_s": ended,
                    "drain_timeout_s": COORDINATOR_DRAIN, "exit_code": proc.returncode, "lost_without_event": 0})
