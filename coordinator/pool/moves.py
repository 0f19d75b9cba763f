"""A draining worker's kept sessions moved to the other workers of its model, so that a rolling restart
loses no conversation.

Owns: one move task per draining worker (started by its heartbeat saying `draining`; supervised: an
unexpected exception is logged and counted, and the task ends), choosing each session's new worker,
the move itself (the session's KV blob fetched from the draining worker and put to the chosen one:
`GET` / `PUT /worker/sessions/{id}/kv`), re-pointing the session's affinity there, and ending it on
the draining worker. Also ending one kept session on its worker when its client asks (`end`,
for surfaces/sessions.py). A session no worker can take now is tried again every RETRY until the move's
deadline. A session that cannot move (refused, the draining worker gone, no room until the deadline)
stays where it is and is lost with it, as before: its next turn is refused (502 while the coordinator still
lists the stopped worker, 404 once the worker restarted without it); it is never restarted anywhere
in silence.
Must not: pick workers for requests (the scheduler does) or decide when a worker drains (it does).

Why through the coordinator, not worker to worker: the coordinator already knows every worker of the
model, their room, and holds the worker token and a connection pool to each; a worker would need a
peer list and outbound access to its peers. A blob crosses two loopback or LAN hops instead of one:
SmolLM2's 23,040 bytes a token make a 500-token session 11.5 MB, tens of milliseconds either way,
against seconds to prefill it again. A session busy with a stream when the drain starts moves once
that stream has ended (the worker lets its streams finish first).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import quote

from coordinator.metrics import CoordinatorMetrics
from coordinator.pool.registry import Registry, WorkerRecord
from coordinator.upstream import WorkerClient, WorkerRefused, WorkerUnreachable
from protocol.health import SessionInfo, SessionList
from protocol.worker import KV_MEDIA_TYPE, SESSIONS_PATH
from serving import tracing
from serving.tracing import TRACEPARENT, Trace, Tracing

log = logging.getLogger("coordinator.moves")
LIST_LIMIT = 16 << 20  # a worker's session list: a few hundred bytes a session
POLL = 0.2  # seconds between looks at a draining worker whose sessions are still busy
RETRY = 0.5  # seconds between tries of a session no worker could take (unreachable, or no room)
MOVED, LATER, GIVEN_UP = "moved", "later", "given_up"
DONE_REMEMBERED = 4096  # drained workers remembered as dealt with (older ones could be moved again)


class SessionMover:
    def __init__(self, registry: Registry, moved: Callable[[tuple[str, str], str], None], client: WorkerClient,
                 metrics: CoordinatorMetrics, *, timeout: float, max_bytes: int,
                 deadline: float, now: Callable[[], float], tracing: Tracing | None = None) -> None:
        """`moved((tenant, session id), worker id)`: a session now lives on that worker (the affinity table remembers
        it); `timeout`: one session's move, fetch and put; `deadline`: a draining worker's moves in all;
        `tracing`: where each move's span goes (a trace of its own; both workers' spans join it). `client`
        carries the worker token (upstream.with_token)."""
        self._registry = registry
        self._moved = moved
        self._client = client
        self._metrics = metrics
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._deadline = deadline
        self._now = now
        self._tracing = tracing
        self._moving: dict[str, asyncio.Task[None]] = {}  # by worker id: one task a draining worker
        # Workers whose drain was dealt with: every heartbeat of theirs says `draining` until they stop,
        # and their sessions are moved once a drain (a session given up on stays given up on).
        self._done: OrderedDict[str, None] = OrderedDict()

    def draining(self, record: WorkerRecord) -> None:
        """`record` said it drains: move its kept sessions, once a drain."""
        if record.worker_id in self._moving or record.worker_id in self._done:
            return
        task = asyncio.create_task(self._supervised(record.worker_id, record.url, record.model))
        self._moving[record.worker_id] = task

    async def end(self, record: WorkerRecord, session_id: str, tenant: str) -> int | None:
        """Asks `record` to end `tenant`'s kept session `session_id` and free its KV (`DELETE
        /worker/sessions/{id}`): the worker's status, or None when it did not answer."""
        url = f"{record.url.rstrip('/')}{SESSIONS_PATH}/{quote(session_id)}?tenant={quote(tenant)}"
        try:
            return await self._client.delete(url, {})
        except WorkerUnreachable:
            return None

    def serving(self, worker_id: str) -> None:
        """`worker_id` heartbeats as not draining (a restart under the same id): its next drain moves again."""
        self._done.pop(worker_id, None)

    async def close(self) -> None:
        for task in self._moving.values():
            task.cancel()
        await asyncio.gather(*self._moving.values(), return_exceptions=True)

    async def _supervised(self, worker_id: str, url: str, model: str) -> None:
        try:
            await self._move_all(worker_id, url, model)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not leave the task's exception unread: logged, counted
            log.exception(json.dumps({"event": "session_moves_failed", "worker_id": worker_id}))
            self._metrics.internal_errors.labels(task="session_mover").inc()
        finally:
            self._moving.pop(worker_id, None)
            self._done[worker_id] = None
            while len(self._done) > DONE_REMEMBERED:
                self._done.popitem(last=False)

    async def _move_all(self, worker_id: str, url: str, model: str) -> None:
        """Until the worker holds no kept session this can move, it is gone, or the deadline. A session no
        other worker could take now (each unreachable or full) is tried again every RETRY: the worker
        that was to receive a drain's sessions may be restarting itself (a rolling restart), and was
        beating again 1.4 s after it was killed while the drain went on (issue 33: before, the other
        sessions were given up 50 ms after the first refusal)."""
        deadline = self._now() + self._deadline
        given_up: set[tuple[str, str]] = set()
        later: dict[tuple[str, str], SessionInfo] = {}
        moved = 0
        while self._now() < deadline:
            listed = await self._listed(worker_id, url)
            if listed is None:
                break  # gone: what it held is lost with it
            waiting = [s for s in listed if (s.tenant, s.session_id) not in given_up]
            if not waiting:
                break
            idle = [s for s in waiting if not s.busy]
            if not idle:
                await asyncio.sleep(POLL)  # a stream still runs on each: they end before the worker does
                continue
            for session in idle:
                key = (session.tenant, session.session_id)
                outcome = await self._move_one(worker_id, url, model, session)
                later.pop(key, None)
                if outcome == MOVED:
                    moved += 1
                elif outcome == LATER:
                    later[key] = session
                else:
                    given_up.add(key)
            if later:
                await asyncio.sleep(RETRY)
        for session in later.values():
            self._counted("no_room", session, worker_id)
        log.info(json.dumps({"event": "session_moves_done", "worker_id": worker_id, "moved": moved,
                             "not_moved": len(given_up) + len(later)}))

    async def _listed(self, worker_id: str, url: str) -> list[SessionInfo] | None:
        try:
            status, body = await self._client.exchange("GET", url.rstrip("/") + SESSIONS_PATH, {},
                                                       limit=LIST_LIMIT, timeout=self._timeout)
        except WorkerRefused:
            self._registry.lost(worker_id, self._now())  # it exited: no more turns go to what it held
            return None
        except WorkerUnreachable:
            return None
        return SessionList.model_validate_json(body).sessions if status == 200 else None

    async def _move_one(self, worker_id: str, url: str, model: str, session: SessionInfo) -> str:
        """MOVED; LATER when no other worker could take it now; GIVEN_UP when it never will move."""
        with tracing.span(self._tracing, "session move", {}, {
                "llm_pool.worker": worker_id, "llm_pool.tenant": session.tenant,
                "llm_pool.session_tokens": session.tokens}) as trace:
            given = trace.traceparent()
            outcome = await self._move(worker_id, url, model, session, {TRACEPARENT: given} if given else {}, trace)
            trace.set({"llm_pool.outcome": outcome})
            return outcome

    async def _move(self, worker_id: str, url: str, model: str, session: SessionInfo, traced: dict[str, str],
                    trace: Trace) -> str:
        query = f"/{session.session_id}/kv?tenant={session.tenant}"
        started = self._now()
        try:
            status, blob = await self._client.exchange("GET", url.rstrip("/") + SESSIONS_PATH + query, traced,
                                                       limit=self._max_bytes, timeout=self._timeout)
        except WorkerUnreachable:
            return self._counted("source_failed", session, worker_id)
        if status != 200:  # busy again, ended meanwhile, or the worker cannot export
            return self._counted("source_refused", session, worker_id)
        for target in self._targets(worker_id, model, session):
            try:
                status, _ = await self._client.exchange(
                    "PUT", target.url.rstrip("/") + SESSIONS_PATH + query, {**traced, "content-type": KV_MEDIA_TYPE},
                    blob, limit=LIST_LIMIT, timeout=self._timeout)
            except WorkerRefused:
                self._registry.lost(target.worker_id, self._now())  # restarting, perhaps: back when it beats
                continue
            except WorkerUnreachable:
                continue
            if status == 201:
                trace.set({"llm_pool.to_worker": target.worker_id, "llm_pool.bytes": len(blob)})
                self._moved((session.tenant, session.session_id), target.worker_id)
                try:  # the draining worker's copy: it would go with the worker anyway
                    ended = f"/{session.session_id}?tenant={session.tenant}"
                    await self._client.exchange("DELETE", url.rstrip("/") + SESSIONS_PATH + ended, {},
                                                limit=LIST_LIMIT, timeout=self._timeout)
                except WorkerUnreachable:
                    pass
                self._metrics.session_moves.labels(outcome="moved").inc()
                self._metrics.session_move_bytes.inc(len(blob))
                self._metrics.session_move_seconds.observe(self._now() - started)
                log.info(json.dumps({"event": "session_moved", "session_id": session.session_id, "from": worker_id,
                                     "to": target.worker_id, "tokens": session.tokens, "bytes": len(blob),
                                     "ms": round((self._now() - started) * 1e3, 1)}))
                return MOVED
            if status == 400:  # this blob lands nowhere (another build, damaged): no next worker
                return self._counted("refused", session, worker_id)
        return LATER

    def _targets(self, worker_id: str, model: str, session: SessionInfo) -> list[WorkerRecord]:
        """The model's other alive workers that say they have room for it, most free KV first; their
        own admission decides (a 503 sends the move to the next)."""
        def free_kv(record: WorkerRecord) -> int:
            return record.kv_capacity_bytes - record.kv_reserved_bytes + record.idle_kv_bytes

        fits = [r for r in self._registry.alive(model) if r.worker_id != worker_id and not r.draining
                and session.tokens <= r.session_max_tokens and r.sessions - r.idle_sessions < r.max_sessions
                and free_kv(r) >= session.tokens * r.bytes_per_token]
        return sorted(fits, key=free_kv, reverse=True)

    def _counted(self, outcome: str, session: SessionInfo, worker_id: str) -> str:
        self._metrics.session_moves.labels(outcome=outcome).inc()
        log.warning(json.dumps({"event": "session_not_moved", "session_id": session.session_id,
                                "worker_id": worker_id, "outcome": outcome}))
        return GIVEN_UP
