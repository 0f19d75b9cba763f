"""A stream that outlives its worker: when the worker's stream breaks after its first token, the rest of
the request goes on on another worker, and the relay reads on as if nothing happened.

Owns: the token ids the client has been sent (each `token` event's `ids`, which the coordinator asks a
worker for: `GenerateRequest.token_ids`), telling a break the request may survive (the stream broke
off, ended without its final event, or ended with a worker's or engine's failure) from an ending, the
bounded count of continuations, the switch to the stream that continues it (the old worker's request
closed and its reservation given back through `left`, before the new one's first event goes on), and
the explicit `error` event naming why when no continuation is possible.
Must not: place anything (its `resume` callable, the gateway's, admits and places the continuation
on a worker the failed ones are left out of), or write to the client (the relay and response do).

Why nothing is sent twice or lost: a worker's token event names the ids its text covers, and text a
worker held back (a character not yet whole, a possible stop string) was never sent and its tokens
named nowhere: the continuation's worker prefills the prompt and exactly the ids sent (`generated`),
and generates from there, its first new token numbered after them. Stop strings match across the seam
because released text never ends inside a stop string's beginning. A kept session is not continued:
its history died with its worker (the next turn's `unknown_session` says so).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson

from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics
from coordinator.relay.dispatch import OpenStream
from coordinator.upstream import WorkerStreamError
from protocol import reasons
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, ErrorEvent

log = logging.getLogger("coordinator")
# The endings a continuation may mend: the worker (or its engine) failed, or it is stopping.
CONTINUABLE = frozenset({reasons.WORKER_FAILED, reasons.ENGINE_FAILED, reasons.DRAINING})

# Given the ids the client has, the workers to leave out, whether it may wait in the queue for room and a live
# worker that holds its cells (a draining one: the next may fetch them instead of prefilling), the stream
# that goes on (its worker's first event read), or a `CoordinatorError` saying why none took it.
Resume = Callable[[list[int], frozenset[str], bool, str | None], Awaitable[OpenStream]]


@dataclass(frozen=True, slots=True)
class Break:
    """Why a worker's stream stopped short of its end (for the log and the client's error event)."""

    worker_id: str
    why: str
    failed: bool = True  # False: its worker drains, and failed nothing


class Continuing:
    """An `Upstream` (relay/stream.py) over a worker's stream that continues on another worker, at most
    `at_most` times, when it breaks after its first token. `left(stream, broke)` runs once for each
    stream it leaves (its reservation back, its worker's breaker told). Each break is counted by how it
    went, and each continuation's pause (from the break to its first event) observed."""

    __slots__ = ("_at_most", "_failed", "_ids", "_iterator", "_left", "_metrics", "_move_from", "_not_continued", "_resume", "_why_not",
                 "continuations", "current", "first", "request_id")

    def __init__(self, stream: OpenStream, resume: Resume, *, request_id: str, at_most: int,
                 left: Callable[[OpenStream, Break], None], metrics: CoordinatorMetrics,
                 not_continued: str = "") -> None:
        """`not_continued`: why this request is never continued (its error event says so), if it is not."""
        self.current = stream
        self.first = stream.first
        self.request_id = request_id
        self.continuations = 0
        self._resume = resume
        self._at_most = at_most
        self._left = left
        self._metrics = metrics
        self._failed: set[str] = set()
        self._iterator: AsyncIterator[SseEvent] | None = None
        self._move_from: str | None = None  # a draining worker this stream should leave, at its next event
        self._not_continued = not_continued
        self._why_not = ""  # why the last break was not continued, for the client's error event
        # The ids the client has been sent, in order; None once a token event came without them (a worker
        # that was not asked, or cannot tell): such a stream ends as it ends, never continued.
        self._ids: list[int] | None = [] if at_most > 0 else None
        self._note(stream.first)

    @property
    def generated(self) -> list[int] | None:
        return self._ids

    @property
    def events(self) -> AsyncIterator[SseEvent]:
        """One iterator, however often asked: the relay reads the stream's end from where it stopped."""
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def close(self) -> None:
        await self.current.close()

    def move(self, worker_id: str) -> None:
        """`worker_id` drains: if this stream runs there, it tries, after its next event, to go on on another
        worker with room (one try, no wait in the queue), and stays where it is when none has; the next
        call (the worker's next heartbeat) tries again."""
        if self.current.worker.worker_id == worker_id:
            self._move_from = worker_id

    async def _events(self) -> AsyncIterator[SseEvent]:
        stream, events = self.current, self.current.events
        while True:
            broke, taken = "", None
            try:
                async for event in events:
                    if event.event == EVENT_ERROR and self._mendable(event):
                        broke = f"the worker ended it with an error: {event.data[:200]}"
                        break
                    self._note(event)
                    yield event
                    if event.event in (EVENT_DONE, EVENT_ERROR):
                        async for rest in events:  # the body's end: its connection goes back to the pool
                            yield rest
                        return
                    if self._move_from is not None and (taken := await self._moved(stream)) is not None:
                        break
                else:
                    broke = "the worker's stream ended without a done event"
            except WorkerStreamError as exc:
                broke = f"the worker's stream broke off: {exc}"
            if taken is None:
                taken = await self._switch(Break(stream.worker.worker_id, broke))
            if taken is None:
                yield self._give_up()
                return
            stream, events = taken, _after(taken.first, taken.events)

    async def _moved(self, stream: OpenStream) -> OpenStream | None:
        """The stream that takes over from one whose worker drains, or None: it stays (no continuation
        left, or no worker with room now). The other worker may fetch the stream's cells from the draining
        one (which still holds them) instead of prefilling. The draining worker's request is closed once
        the other's first event is here: what it generated past the ids sent is never sent, and is
        generated again there."""
        worker_id, self._move_from = self._move_from, None
        if worker_id != stream.worker.worker_id or self._ids is None or self.continuations >= self._at_most:
            return None  # asked while a move was under way: it has left that worker already
        try:
            taken = await self._resume(list(self._ids), frozenset({*self._failed, worker_id}), False, worker_id)
        except CoordinatorError as exc:
            self._metrics.stream_moves.labels(outcome="stayed").inc()
            log.info(json.dumps({"event": "stream_stays", "request_id": self.request_id, "worker_id": worker_id,
                                 "reason": exc.reason}))
            return None
        self.continuations += 1
        self._left(stream, Break(worker_id, "its worker drains", failed=False))
        await stream.close()
        self.current = taken
        self._metrics.stream_moves.labels(outcome="moved").inc()
        log.info(json.dumps({"event": "stream_moved", "request_id": self.request_id, "from": worker_id,
                             "to": taken.worker.worker_id, "generated": len(self._ids)}))
        return taken

    def _mendable(self, event: SseEvent) -> bool:
        """An error event a continuation may mend (when continuations are left)."""
        if self._ids is None or self.continuations >= self._at_most:
            return False
        try:
            reason = ErrorEvent.model_validate_json(event.data).reason
        except ValueError:
            return False
        return reason in CONTINUABLE

    def _note(self, event: SseEvent) -> None:
        """The ids a token event's text covers, added to what the client has."""
        ids = self._ids
        if ids is None or event.event != EVENT_TOKEN:
            return
        covered = orjson.loads(event.data).get("ids")
        if isinstance(covered, list):
            ids.extend(covered)
        else:
            self._ids = None

    async def _switch(self, broke: Break) -> OpenStream | None:
        """The stream that takes over from the broken one, or None (`_why_not` says why)."""
        old = self.current
        self._failed.add(broke.worker_id)
        self._left(old, broke)
        await old.close()
        log.warning(json.dumps({"event": "worker_stream_broke", "request_id": self.request_id,
                                "worker_id": broke.worker_id, "error": broke.why,
                                "continuable": self._ids is not None and self.continuations < self._at_most}))
        self._why_not = ""
        if self._ids is None:
            self._why_not = self._not_continued or ("" if self._at_most == 0 else
                                                    "this stream cannot be continued on another worker")
            return None
        if self.continuations >= self._at_most:
            self._why_not = f"continued {self.continuations} times already, the most (CONTINUATIONS)"
            return None
        self.continuations += 1
        started = time.monotonic()
        try:
            stream = await self._resume(list(self._ids), frozenset(self._failed), True, None)
        except CoordinatorError as exc:
            self._why_not = f"no other worker could continue it ({exc.reason}: {exc.message})"
            log.warning(json.dumps({"event": "continuation_failed", "request_id": self.request_id,
                                    "reason": exc.reason, "error": exc.message}))
            return None
        self.current = stream
        self._metrics.continuation_pause.observe(time.monotonic() - started)
        self._metrics.stream_breaks.labels(outcome="continued").inc()
        log.info(json.dumps({"event": "stream_continued", "request_id": self.request_id,
                             "from": broke.worker_id, "to": stream.worker.worker_id,
                             "generated": len(self._ids), "continuation": self.continuations}))
        return stream

    def _give_up(self) -> SseEvent:
        """The error event that ends a stream no continuation took, and why none did (what broke is
        logged only: the client gets the reason and a short message)."""
        self._metrics.stream_breaks.labels(outcome="ended").inc()
        message = "the worker's stream broke off before its end"
        if self._why_not:
            message += f", and {self._why_not}"
        return SseEvent(EVENT_ERROR, ErrorEvent(error=message, reason=reasons.WORKER_FAILED,
                                                request_id=self.request_id).model_dump_json())


async def _after(first: SseEvent, events: AsyncIterator[SseEvent]) -> AsyncIterator[SseEvent]:
    """A continuation's events: its first (read when it was placed), then the rest."""
    yield first
    async for event in events:
        yield event
