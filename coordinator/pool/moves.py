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
import uuid
from collections.abc import Callable
from urllib.parse import quote

from coordinator.metrics import CoordinatorMetrics
from coordinator.pool.drains import OncePerDrain
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
        # Who moves, as the draining worker hears it: the session an export handed to this coordinator
        # is this coordinator's to export again when its put failed; no other coordinator's.
        self._mover = uuid.uuid4().hex[:16]
        # One task a draining worker, once a drain (a session given up on stays given up on).
        self._drains = OncePerDrain()

    def draining(self, record: WorkerRecord) -> None:
        """`record` said it drains: move its kept sessions, once a drain."""
        self._drains.start(record.worker_id, lambda: self._supervised(record.worker_id, record.url, record.model))

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
        self._drains.serving(worker_id)

    async def close(self) -> None:
        await self._drains.close()

    async def _supervised(self, worker_id: str, url: str, model: str) -> None:
        try:
            await self._move_all(worker_id, url, model)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not leave the task's exception unread: logged, counted
            log.exception(json.dumps({"event": "session_moves_failed", "worker_id": worker_id}))
            self._metrics.internal_errors.labels(task="session_mover").inc()

    async def _move_all(self, worker_id: str, url: str, model: str) -> None:
        """Until the worker holds no kept session this can move, it is gone, or the deadline. A session no
        other worker could take now (each unreachable or full, or the draining worker's transfer slots
        busy) is tried again every RETRY: the worker that was to receive a drain's sessions may be
        restarting itself (a rolling restart), and was beating again 1.4 s after it was killed while
        the drain went on (issue 33). The draining worker waits while it is listed (runtime.py's
        HANDOVER_GRACE), so the tries go on until its own drain deadline, or this move's."""
        deadline = self._now() + self._deadline
        given_up: set[tuple[str, str]] = set()
        later: dict[tuple[str, str], tuple[SessionInfo, str]] = {}  # and why it did not move yet
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
                outcome, why = await self._move_one(worker_id, url, model, session)
                if outcome == MOVED:
                    moved += 1
                    later.pop(key, None)
                elif outcome == LATER:
                    if key not in later:
                        log.info(json.dumps({"event": "session_move_deferred", "session_id": session.session_id,
                                             "worker_id": worker_id, "cause": why}))
                    later[key] = (session, why)
                else:
                    later.pop(key, None)
                    given_up.add(key)
            if later:
                await asyncio.sleep(RETRY)
        for session, why in later.values():
            self._counted("no_room", session, worker_id, why)
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

    async def _move_one(self, worker_id: str, url: str, model: str, session: SessionInfo) -> tuple[str, str]:
        """(MOVED; LATER when no other worker could take it now; GIVEN_UP when it never will move, and why)."""
        with tracing.span(self._tracing, "session move", {}, {
                "llm_pool.worker": worker_id, "llm_pool.tenant": session.tenant,
                "llm_pool.session_tokens": session.tokens}) as trace:
            given = trace.traceparent()
            outcome, why = await self._move(worker_id, url, model, session, {TRACEPARENT: given} if given else {},
                                            trace)
            trace.set({"llm_pool.outcome": outcome})
            return outcome, why

    async def _move(self, worker_id: str, url: str, model: str, session: SessionInfo, traced: dict[str, str],
                    trace: Trace) -> tuple[str, str]:
        targets = self._targets(worker_id, model, session)
        if not targets:  # not exported until a worker has room: an export hands the session to this mover
            return LATER, "no other alive worker of the model has room for it now"
        query = f"/{session.session_id}/kv?tenant={session.tenant}"
        started = self._now()
        try:
            status, blob = await self._client.exchange(
                "GET", f"{url.rstrip('/')}{SESSIONS_PATH}{query}&mover={self._mover}", traced,
                limit=self._max_bytes, timeout=self._timeout)
        except WorkerUnreachable as exc:  # cut off mid-blob, or gone: the blob is not to be had from it
            return self._counted("source_failed", session, worker_id, f"the draining worker's export failed: {exc}"), ""
        if status == 503:  # its transfer slots are busy (or it is loading): a moment later
            return LATER, f"the draining worker's export: {_refusal(status, blob)}"
        if status != 200:  # ended meanwhile (404), or another coordinator moves it (409)
            return self._counted("source_refused", session, worker_id,
                                 f"the draining worker's export: {_refusal(status, blob)}"), ""
        causes: list[str] = []
        for target in targets:
            status, why = await self._put(target, SESSIONS_PATH + query, {**traced, "content-type": KV_MEDIA_TYPE},
                                          blob)
            if status == 201:
                trace.set({"llm_pool.to_worker": target.worker_id, "llm_pool.bytes": len(blob)})
                await self._landed(worker_id, url, target, session, len(blob), started)
                return MOVED, ""
            causes.append(f"{target.worker_id}: {why}")
            if status == 400:  # this blob lands nowhere (another build, damaged): no next worker
                return self._counted("refused", session, worker_id, "; ".join(causes)), ""
        return LATER, "; ".join(causes)

    async def _put(self, target: WorkerRecord, path: str, headers: dict[str, str], blob: bytes) -> tuple[int, str]:
        """`target`'s status for the blob (0: no answer), and why it did not take it."""
        try:
            status, body = await self._client.exchange("PUT", target.url.rstrip("/") + path, headers, blob,
                                                       limit=LIST_LIMIT, timeout=self._timeout)
        except WorkerRefused as exc:
            self._registry.lost(target.worker_id, self._now())  # restarting, perhaps: back when it beats
            return 0, f"gone ({exc})"
        except WorkerUnreachable as exc:  # killed mid-move, or too slow
            return 0, f"no answer ({exc})"
        return status, "" if status == 201 else _refusal(status, body)

    async def _landed(self, worker_id: str, url: str, target: WorkerRecord, session: SessionInfo, size: int,
                      started: float) -> None:
        self._moved((session.tenant, session.session_id), target.worker_id)
        try:  # the draining worker's copy: it would go with the worker anyway
            ended = f"/{session.session_id}?tenant={session.tenant}"
            await self._client.exchange("DELETE", url.rstrip("/") + SESSIONS_PATH + ended, {},
                                        limit=LIST_LIMIT, timeout=self._timeout)
        except WorkerUnreachable:
            pass
        self._metrics.session_moves.labels(outcome="moved").inc()
        self._metrics.session_move_bytes.inc(size)
        self._metrics.session_move_seconds.observe(self._now() - started)
        log.info(json.dumps({"event": "session_moved", "session_id": session.session_id, "from": worker_id,
                             "to": target.worker_id, "tokens": session.tokens, "bytes": size,
                             "ms": round((self._now() - started) * 1e3, 1)}))

    def _targets(self, worker_id: str, model: str, session: SessionInfo) -> list[WorkerRecord]:
        """The model's other alive workers that say they have room for it, most free KV first; their
        own admission decides (a 503 sends the move to the next)."""
        def free_kv(record: WorkerRecord) -> int:
            return record.kv_capacity_bytes - record.kv_reserved_bytes + record.idle_kv_bytes

        fits = [r for r in self._registry.alive(model) if r.worker_id != worker_id and not r.draining
                and session.tokens <= r.session_max_tokens and r.sessions - r.idle_sessions < r.max_sessions
                and free_kv(r) >= session.tokens * r.bytes_per_token]
        return sorted(fits, key=free_kv, reverse=True)

    def _counted(self, outcome: str, session: SessionInfo, worker_id: str, cause: str) -> str:
        self._metrics.session_moves.labels(outcome=outcome).inc()
        log.warning(json.dumps({"event": "session_not_moved", "session_id": session.session_id,
                                "worker_id": worker_id, "outcome": outcome, "cause": cause}))
        return GIVEN_UP


def _refusal(status: int, body: bytes) -> str:
    """A worker's refusal as a log reads it: the status, and the reason and message of its error body."""
    try:
        error = json.loads(body)
        return f"{status} {error.get('reason', '')}: {str(error.get('error', ''))[:200]}"
    except (ValueError, AttributeError):
        return f"{status} {body[:200]!r}"
