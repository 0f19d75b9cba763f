"""Where stored Responses live: on the worker that ran each one (worker/api/records.py), found through
any coordinator.

Owns: writing a record to the worker that ran its response, reading one back and deleting it, and
finding which worker holds it: the worker this coordinator last saw it on (a bounded map, least
recently used forgotten first), else every live worker asked at once (the first to have it answers;
a coordinator that restarted, or another coordinator's response, is found so). Every call bounded by
`timeout` and its answer by `limit` bytes.
Must not: shape or read a record (the Responses surface does), or pick where a turn runs (the record
names its session; session affinity sends the turn there).

Why no store of its own: a record is small and its next turn needs the KV of the worker that ran it,
so it lives there; the pool then needs no database, and a chain survives any coordinator's restart.
It does not survive its worker's (the KV would not either): the next turn gets
`previous_response_not_found`, as OpenAI answers for a response it no longer has.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote

from coordinator.pool.registry import Registry, WorkerRecord
from coordinator.upstream import WorkerClient, WorkerUnreachable
from protocol.worker import RESPONSES_PATH

Key = tuple[str, str]  # (tenant, response id)


@dataclass(frozen=True, slots=True)
class Found:
    worker_id: str
    body: bytes


class StoredResponses:
    """`put(worker_id, key, session_id, body)`, `get(key)`, `delete(key)`."""

    def __init__(self, registry: Registry, client: WorkerClient, *, timeout: float, limit: int,
                 remembered: int = 65536) -> None:
        self._registry = registry
        self._client = client
        self._timeout = timeout
        self._limit = limit
        self._remembered = remembered
        self._where: OrderedDict[Key, str] = OrderedDict()

    async def put(self, worker_id: str, key: Key, session_id: str, body: bytes) -> bool:
        """Whether `worker_id` kept the record (False: gone, unreachable or refused; the log says)."""
        record = self._registry.get(worker_id)
        if record is None:
            return False
        url = self._url(record, key) + (f"&session_id={quote(session_id)}" if session_id else "")
        status = await self._exchange("PUT", url, body)
        if status is None or status[0] != 204:
            return False
        self._remember(key, worker_id)
        return True

    async def get(self, key: Key) -> Found | None:
        """The record and the worker holding it; None where no live worker has it."""
        known = self._where.get(key)
        record = self._registry.get(known) if known is not None else None
        if record is not None:
            found = await self._ask(record, key)
            if found is not None:
                self._where.move_to_end(key)
                return found
        asks = [asyncio.create_task(self._ask(r, key)) for r in self._registry.alive() if r.worker_id != known]
        try:
            for ask in asyncio.as_completed(asks):
                found = await ask
                if found is not None:
                    self._remember(key, found.worker_id)
                    return found
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        self._where.pop(key, None)
        return None

    async def delete(self, key: Key) -> bool:
        """Whether a worker held the record (and has forgotten it now)."""
        found = await self.get(key)
        record = self._registry.get(found.worker_id) if found is not None else None
        if record is None:
            return False
        status = await self._exchange("DELETE", self._url(record, key), None)
        self._where.pop(key, None)
        return status is not None and status[0] == 204

    async def _ask(self, record: WorkerRecord, key: Key) -> Found | None:
        answer = await self._exchange("GET", self._url(record, key), None)
        if answer is None or answer[0] != 200:
            return None
        return Found(record.worker_id, answer[1])

    async def _exchange(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes] | None:
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            return await self._client.exchange(method, url, headers, body, limit=self._limit, timeout=self._timeout)
        except WorkerUnreachable:
            return None

    @staticmethod
    def _url(record: WorkerRecord, key: Key) -> str:
        tenant, response_id = key
        return f"{record.url.rstrip('/')}{RESPONSES_PATH}/{quote(response_id)}?tenant={quote(tenant)}"

    def _remember(self, key: Key, worker_id: str) -> None:
        self._where[key] = worker_id
        self._where.move_to_end(key)
        while len(self._where) > self._remembered:
            self._where.popitem(last=False)
