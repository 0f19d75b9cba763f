"""Where stored Responses live: on the worker that ran each one (worker/api/records.py), found through
any coordinator.

Owns: writing a record to the worker that ran its response, reading one back and deleting it, and
finding which worker holds it: the worker this coordinator last saw it on (a bounded map, least
recently used forgotten first), else every live worker asked at once (the first to have it answers;
a coordinator that restarted, or another coordinator's response, is found so). Every call bounded by
`timeout` and its answer by `limit` bytes.
A draining worker's records are moved (`draining`, once a drain, supervised): taken from it in batches
(`POST /worker/responses/handover`, each record taken once, so of several coordinators one moves it)
and put on the other live workers in turn; a record no worker takes is lost, and logged. Their KV is
not moved (it is the draining worker's prompt cache): a chain's next turn is prefilled whole.
Must not: shape or read a record (the Responses surface does), or pick where a turn runs (the turn
prefers the worker that holds the record: affinity/placement.py).

Why no store of its own: a record is small and its next turn needs the KV of the worker that ran it,
so it lives there; the pool then needs no database, and a chain survives any coordinator's restart.
It does not survive its worker's crash (the KV would not either): the next turn gets
`previous_response_not_found`, as OpenAI answers for a response it no longer has.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote

from coordinator.pool.drains import OncePerDrain
from coordinator.pool.registry import Registry, WorkerRecord
from coordinator.upstream import WorkerClient, WorkerUnreachable
from protocol.worker import RESPONSES_HANDOVER_PATH, RESPONSES_PATH

log = logging.getLogger("coordinator.records")
HANDOVER_BYTES = 8 << 20  # records taken from a draining worker per call

Key = tuple[str, str]  # (tenant, response id)


@dataclass(frozen=True, slots=True)
class Found:
    worker_id: str
    body: bytes


class StoredResponses:
    """`put(worker_id, key, body)`, `get(key)`, `delete(key)`."""

    def __init__(self, registry: Registry, client: WorkerClient, *, timeout: float, limit: int,
                 remembered: int = 65536) -> None:
        self._registry = registry
        self._client = client
        self._timeout = timeout
        self._limit = limit
        self._remembered = remembered
        self._where: OrderedDict[Key, str] = OrderedDict()
        self._drains = OncePerDrain()
        self._turns = itertools.count()

    def draining(self, record: WorkerRecord) -> None:
        """`record` said it drains: move its stored responses to the other workers, once a drain."""
        self._drains.start(record.worker_id, lambda: self._supervised(record))

    def serving(self, worker_id: str) -> None:
        """`worker_id` serves again (a restart under the same id): its next drain moves again."""
        self._drains.serving(worker_id)

    async def close(self) -> None:
        await self._drains.close()

    async def _supervised(self, source: WorkerRecord) -> None:
        moved = lost = 0
        try:
            moved, lost = await self._move_all(source)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not leave the task's exception unread
            log.exception(json.dumps({"event": "responses_move_failed", "worker_id": source.worker_id}))
        if moved or lost:
            log.warning(json.dumps({"event": "responses_moved", "from": source.worker_id, "moved": moved,
                                    "lost": lost}))

    async def _move_all(self, source: WorkerRecord) -> tuple[int, int]:
        moved = lost = 0
        url = f"{source.url.rstrip('/')}{RESPONSES_HANDOVER_PATH}?max_bytes={HANDOVER_BYTES}"
        while True:
            answer = await self._exchange("POST", url, b"")
            if answer is None or answer[0] != 200:
                return moved, lost
            taken = json.loads(answer[1])["records"]
            if not taken:
                return moved, lost
            for one in taken:
                key = (one["tenant"], one["response_id"])
                body = json.dumps(one["record"], separators=(",", ":")).encode()
                if await self._put_elsewhere(source.worker_id, key, body):
                    moved += 1
                else:
                    lost += 1

    async def _put_elsewhere(self, source: str, key: Key, body: bytes) -> bool:
        targets = [r for r in self._registry.alive() if r.worker_id != source and not r.draining]
        if not targets:
            return False
        first = next(self._turns) % len(targets)
        for record in targets[first:] + targets[:first]:
            if await self.put(record.worker_id, key, body):
                return True
        return False

    async def put(self, worker_id: str, key: Key, body: bytes) -> bool:
        """Whether `worker_id` kept the record (False: gone, unreachable or refused; the log says)."""
        record = self._registry.get(worker_id)
        if record is None:
            return False
        if record.draining:  # a response that ended on a draining worker: its records are moving away
            return await self._put_elsewhere(worker_id, key, body)
        url = self._url(record, key)
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
