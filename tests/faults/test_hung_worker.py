"""A worker that stops answering without dying (SIGSTOP) is found by silence within seconds, not by
heartbeat age: its streams go on on another worker, and new requests fail over away from it."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from typing import Any

import httpx
import pytest

from tests.faults.conftest import since
from tests.faults.pool import FaultPool
from tests.faults.test_drain import LONG, open_stream
from tests.integration.streams import infer
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
READ_TIMEOUT = 5.0  # the coordinator's default worker_read_timeout


async def test_a_stream_on_a_stopped_worker_goes_on_on_the_other_after_the_read_timeout(
        fault_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        long, reading = await open_stream(client, fault_pool.url, LONG)
        victim = long.headers["x-worker-id"]
        fault_pool.workers[victim].signal(signal.SIGSTOP)
        try:
            await asyncio.wait_for(reading, timeout=READ_TIMEOUT + 60)
        finally:
            fault_pool.workers[victim].signal(signal.SIGCONT)
    assert long.names[-1] == "done", long.events[-1]
    indices = [d["index"] for n, d in long.events if n == "token"]  # none twice, none missing
    assert indices == sorted(set(indices)) and indices[-1] == long.events[-1][1]["usage"]["completion_tokens"] - 1
    # The pause: the longest gap between two tokens (the silence, then the other worker's prefill).
    times = long.token_times
    paused = round(max(b - a for a, b in itertools.pairwise(times)), 3)
    assert READ_TIMEOUT - 0.5 <= paused <= READ_TIMEOUT + 5, paused
    wait_until(lambda: fault_pool.listing()[victim]["state"] == "alive", 15, "the worker back after SIGCONT")
    figures.append({"case": "worker SIGSTOP mid-stream", "stream_paused_s": paused, "stream": "continued, whole"})


async def test_new_requests_fail_over_from_a_stopped_worker_before_it_goes_stale(
        fault_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    """Before: routed to the stopped worker, a request waited 35 s (first-event timeout 120 s)."""
    victim = "f1"
    fault_pool.workers[victim].signal(signal.SIGSTOP)
    started = time.monotonic()
    waits: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(4):  # its record is still fresh: some of these are routed to it first
                sent = time.monotonic()
                answer = await infer(client, fault_pool.url, {"prompt": "Hi", "max_tokens": 4})
                waits.append(since(sent))
                assert answer.status == 200 and answer.headers["x-worker-id"] == "f2" and answer.names[-1] == "done"
        unscheduled = since(started)
        # Stale, or already removed (no beat for 6 intervals) when the requests took that long.
        stale = fault_pool.listing().get(victim, {"state": "removed", "breaker": "none"})
    finally:
        fault_pool.workers[victim].signal(signal.SIGCONT)
    assert max(waits) <= READ_TIMEOUT + 3, waits
    assert stale["breaker"] != "closed" or stale["state"] != "alive", stale  # out of scheduling by now
    wait_until(lambda: fault_pool.listing().get(victim, {}).get("breaker") == "closed"
               and fault_pool.listing()[victim]["state"] == "alive", 30, "the worker back in service after SIGCONT")
    back = since(started)
    figures.append({"case": "worker SIGSTOP before the first token", "longest_request_s": max(waits),
                    "requests": len(waits), "client_errors": 0, "out_of_scheduling_after_s": unscheduled,
                    "back_in_service_after_sigcont_s": back})
