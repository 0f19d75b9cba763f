"""Workers proven before trusted: a worker id new to the registry, or at a new URL, is registered only
once that URL answers `GET /worker/health` as that worker.

Owns: the probe (one GET, bounded in time and in how many run at once) and its verdict.
Must not: register workers (the heartbeat route does, once the probe passed) or judge a registered
worker's requests (the breakers do).

Why: a heartbeat is only a claim. Without the probe, a worker that heartbeats but never answers (a
wrong advertised URL, a process behind a firewall, or a liar holding the worker token) was ranked
with the others and cost clients a failover each until its breaker opened, and its idle load won
score ties. The probe costs one request per new registration, not per heartbeat, and its refusal
tells the worker's own log why it is not registered (`worker_unavailable`, naming the URL).
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from coordinator.errors import CoordinatorError
from coordinator.upstream import WorkerClient, WorkerUnreachable
from protocol import reasons
from protocol.health import WorkerHealth
from protocol.worker import HEALTH_PATH

PROBES_AT_ONCE = 16


class Probe:
    def __init__(self, client: WorkerClient, *, timeout: float, at_once: int) -> None:
        self._client = client
        self._timeout = timeout
        self._slots = asyncio.Semaphore(at_once)  # heartbeats from many new ids cannot open many requests

    async def prove(self, worker_id: str, url: str) -> None:
        """Returns once `url` answered as `worker_id`; otherwise a `CoordinatorError` saying why."""
        target = url.rstrip("/") + HEALTH_PATH
        try:
            async with asyncio.timeout(self._timeout), self._slots:
                status, body = await self._client.get(target)
        except (WorkerUnreachable, TimeoutError):
            raise _unproven(f"{target} did not answer within {self._timeout:g} s") from None
        try:
            health = WorkerHealth.model_validate_json(body)
        except ValidationError:
            raise _unproven(f"{target} answered {status}, not a worker's health") from None
        if health.worker_id != worker_id:
            raise _unproven(f"{target} answers as worker {health.worker_id!r}, not {worker_id!r}")
        if health.status == "loading":
            raise _unproven(f"{target} is still loading its model")


def _unproven(why: str) -> CoordinatorError:
    return CoordinatorError(reasons.WORKER_UNAVAILABLE, f"not registered: {why}; a worker is registered once "
                            "the coordinator reaches it at the URL it advertises")
