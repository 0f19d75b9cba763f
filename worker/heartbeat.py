"""Tells the coordinator, every interval, that this worker is alive and how loaded it is.

Owns: the heartbeat loop and its HTTP calls. Must not: fail the worker. A coordinator that is down
or refuses the heartbeat is logged (once per change of state, not every interval) and tried again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from protocol.health import EmbeddingService, Heartbeat, WorkerLoad
from worker.naming import ModelNames

log = logging.getLogger("worker.heartbeat")
HEARTBEAT_PATH = "/coordinator/health/heartbeat"


class HeartbeatSender:
    def __init__(self, *, coordinator_url: str, worker_id: str, worker_url: str, names: ModelNames,
                 token: str, interval: float, load: Callable[[], WorkerLoad], model_identity: str = "",
                 embeddings: EmbeddingService | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._url = coordinator_url.rstrip("/") + HEARTBEAT_PATH
        self._worker_id = worker_id
        self._worker_url = worker_url
        self._names = names
        self._identity = model_identity
        self._embeddings = embeddings
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._interval = interval
        self._load = load
        self._wall_clock = wall_clock
        # Every call has a deadline shorter than the interval, so beats never pile up.
        self._client = httpx.AsyncClient(transport=transport, timeout=min(5.0, interval))
        self._healthy: bool | None = None
        self.sent = 0

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self._worker_id, url=self._worker_url, model=self._names.name,
                         aliases=list(self._names.aliases), model_identity=self._identity,
                         embeddings=self._embeddings, load=self._load(), timestamp=self._wall_clock())

    async def send_once(self) -> bool:
        try:
            response = await self._client.post(self._url, content=self.heartbeat().model_dump_json(),
                                               headers={**self._headers, "Content-Type": "application/json"})
            ok = response.is_success
            problem = f"status {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            ok, problem = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.sent += 1
        if ok != self._healthy:
            if ok:
                log.info('{"event": "heartbeat_ok", "coordinator": "%s"}', self._url)
            else:
                log.warning('{"event": "heartbeat_failed", "coordinator": "%s", "problem": "%s"}',
                            self._url, problem.replace('"', "'"))
            self._healthy = ok
        return ok

    async def run(self) -> None:
        while True:
            await self.send_once()
            await asyncio.sleep(self._interval)

    async def aclose(self) -> None:
        await self._client.aclose()
