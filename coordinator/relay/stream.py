"""Relay: moves one worker stream into one bounded per-client buffer, never dropping an event.

Owns: the reader task (upstream -> buffer), the write deadline on a full buffer, turning a broken
upstream into a final `error` event, and what the stream told us (finish reason, usage, token count)
for the log line and metrics.
Must not: write to the client (response.py does) or place anything on another worker: a live worker
stream reaches it through relay/continuation.py's `Continuing`, which goes on on another worker when
its worker fails mid-stream and otherwise ends it with its own `error` event, so the break handling
here serves the other upstreams (a cached answer's replay).

Why a queue between the two sides: the reader keeps draining the worker at the worker's pace while
the client's socket is busy, up to `buffer_events`. When the buffer stays full past the deadline
the client is not reading; rather than drop tokens or buffer without bound, the relay gives up on
the client (`slow` is set) and closes the worker request, which frees its KV cache at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from coordinator.metrics import CoordinatorMetrics
from coordinator.relay.buffer import EventBuffer
from coordinator.upstream import WorkerStreamError
from protocol import reasons
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, EVENT_ERROR, EVENT_PROMPT, EVENT_TOKEN, DoneEvent, ErrorEvent

TERMINAL = frozenset({EVENT_DONE, EVENT_ERROR})
DRAIN_TIMEOUT = 1.0

log = logging.getLogger("coordinator")


class _SlowConsumer(Exception):
    pass


@dataclass(slots=True)
class Outcome:
    tokens: int = 0
    done: DoneEvent | None = None
    error_reason: str | None = None
    first_token_at: float | None = None  # set by the writer when the first token reached the socket


class Upstream(Protocol):
    """Where the relay reads events: a worker's stream (dispatch.OpenStream) or a cached one."""

    @property
    def first(self) -> SseEvent: ...
    @property
    def events(self) -> AsyncIterator[SseEvent]: ...
    async def close(self) -> None: ...


class Relay:
    __slots__ = ("_abort", "_ended", "_first_ends", "_metrics", "_on_final", "_on_token", "_record_left", "_task",
                 "outcome", "queue", "record", "request_id", "slow", "stream", "write_deadline")

    def __init__(self, stream: Upstream, *, request_id: str, buffer_events: int, write_deadline: float,
                 metrics: CoordinatorMetrics, on_final: Callable[[Outcome], None] | None = None,
                 record_bytes: int = 0, on_token: Callable[[], None] | None = None) -> None:
        """`on_final` runs once, when the stream's final event is read and before it is queued for the
        client: the worker freed the request's slot before sending that event, so whoever learns of
        the end from the client must find the slot free here too (no 503 at the seam). It runs under
        the relay's guard: if it raises, the failure is logged and counted and the client's stream
        ends with an `internal` error event instead of the worker's final event, never without one.
        `on_token` runs for each token event read (its tenant's fair share is charged as it goes)."""
        self.stream = stream
        self._on_final = on_final
        self._on_token = on_token
        # The events as relayed, for the response cache (`record_bytes` > 0); given up past that size.
        self.record: list[SseEvent] | None = [] if record_bytes > 0 else None
        self._record_left = record_bytes
        self.request_id = request_id
        self.queue: EventBuffer[SseEvent] = EventBuffer(buffer_events)
        self.write_deadline = write_deadline
        self.slow = False  # set when the client stopped taking events: the reader gave up on it
        self.outcome = Outcome()
        self._metrics = metrics
        self._ended = False  # a final event is queued for the client (set once it really is)
        self._abort: tuple[str, str] | None = None  # (reason, message) of an `abort`
        self._task: asyncio.Task[None] | None = None  # the reader task, once `run` started
        # The first event is already here (dispatch waited for it): queue it now, so the writer can
        # send it before the reader task has even started.
        first = stream.first
        self._first_ends = self._note(first)
        if self._first_ends:
            first = self._settled(first)
        if self._first_ends is not None:
            self.queue.put_nowait(first)
            self._ended = bool(self._first_ends)

    async def run(self) -> None:
        """The reader task. Always closes the worker response, however it ends, and always leaves a
        final event for the client: an `abort` or a fault of its own ends the stream with `error`."""
        self._task = asyncio.current_task()
        try:
            if self._abort is not None:
                raise asyncio.CancelledError
            if self._first_ends:
                await self._drain()
                return
            try:
                async for event in self.stream.events:
                    if await self._relay(event):
                        await self._drain()
                        return
                message = "the worker's stream ended without a done event"
            except WorkerStreamError as exc:
                # The client gets the reason and a short message; what broke goes to the log only.
                log.warning(json.dumps({"event": "worker_stream_broke", "request_id": self.request_id,
                                        "error": str(exc)}))
                message = "the worker's stream broke off before its end"
            await self._relay(self.error_event(reasons.WORKER_FAILED, message))
        except _SlowConsumer:
            self.slow = True
        except asyncio.CancelledError:
            if self._abort is None:
                raise  # the response is done with this stream (client gone, slow client)
            self._end_with(*self._abort)
        except Exception as exc:  # noqa: BLE001 - a fault of ours: logged, and the stream still ends
            self.internal_error("relay_reader", exc)
            self._end_with(reasons.INTERNAL, "internal error while relaying the worker's stream")
        finally:
            try:
                await self.stream.close()
            finally:
                self._final()  # however it ended: the worker request is closed, its slot is free

    def abort(self, reason: str, message: str) -> None:
        """End the stream now with an `error` event (the coordinator is draining): the worker request
        is closed, which frees its KV. Nothing happens to a stream whose final event is queued."""
        if self._ended or self._abort is not None:
            return
        self._abort = (reason, message)
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _end_with(self, reason: str, message: str) -> None:
        if self._ended:
            return
        event = self.error_event(reason, message)
        self._note(event)
        self._final()  # as for a worker's final event: the slot is free before the client hears
        self.queue.put_last(event)
        self._ended = True

    async def _drain(self) -> None:
        """Read the stream's end (the last chunk follows the final event at once), so closing the
        response hands the connection back to the pool instead of dropping it: a new TCP
        connection per request would cost every request a handshake."""
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT):
                async for _ in self.stream.events:
                    pass
        except (TimeoutError, WorkerStreamError):
            pass  # then closing drops the connection, which is all a stuck worker deserves

    def _note(self, event: SseEvent) -> bool | None:
        """Record what the event says; True when it ends the stream, None when it is not relayed."""
        if self.record is not None and event.event in (EVENT_TOKEN, EVENT_PROMPT, EVENT_DONE, EVENT_ERROR):
            self._record_left -= len(event.data) + 32
            if self._record_left >= 0:
                self.record.append(event)
            else:
                self.record = None
        if event.event == EVENT_TOKEN:
            self.outcome.tokens += 1
            if self._on_token is not None:
                self._on_token()
        elif event.event == EVENT_DONE:
            self.outcome.done = _parse_done(event.data)
        elif event.event == EVENT_ERROR:
            self.outcome.error_reason = _error_reason(event.data)
        elif event.event != EVENT_PROMPT:  # the prompt's scores (`prompt_logprobs`) go on to the surface
            return None  # an event type this coordinator does not know: not the client's business
        return event.event in TERMINAL

    def _settled(self, final: SseEvent) -> SseEvent:
        """The stream's final event as the client gets it, once `on_final` has run: the worker's own,
        or an `internal` error event when the final callback failed."""
        if self._final():
            return final
        self.outcome.done = None
        self.outcome.error_reason = reasons.INTERNAL
        return self.error_event(reasons.INTERNAL, "internal error while finishing the request")

    def _final(self) -> bool:
        """Runs `on_final` once; False when it raised (logged and counted here, never propagated)."""
        on_final, self._on_final = self._on_final, None
        if on_final is None:
            return True
        try:
            on_final(self.outcome)
        except Exception as exc:  # noqa: BLE001 - logged; the client gets an error event instead
            self.internal_error("on_final", exc)
            return False
        return True

    def internal_error(self, task: str, exc: BaseException) -> None:
        """Log (with the traceback) and count a fault of this request's own code, once per fault."""
        log.error(json.dumps({"event": "internal_error", "task": task, "request_id": self.request_id,
                              "error": repr(exc)}), exc_info=exc)
        self._metrics.internal_errors.labels(task=task).inc()

    async def _relay(self, event: SseEvent) -> bool:
        """Queue one event; True when it ends the stream."""
        ends = self._note(event)
        if ends is None:
            return False
        if ends:
            event = self._settled(event)
        if not self.queue.put_nowait(event) and not await self.queue.put(event, self.write_deadline):
            raise _SlowConsumer
        self._ended = ends
        self._metrics.buffer_fill.observe(self.queue.qsize() / self.queue.maxsize)
        return ends

    def error_event(self, reason: str, message: str) -> SseEvent:
        return SseEvent(EVENT_ERROR, ErrorEvent(error=message, reason=reason,
                                                request_id=self.request_id).model_dump_json())


def _parse_done(data: str) -> DoneEvent | None:
    try:
        return DoneEvent.model_validate_json(data)
    except ValidationError:
        return None


def _error_reason(data: str) -> str:
    try:
        return ErrorEvent.model_validate_json(data).reason
    except ValidationError:
        return reasons.WORKER_FAILED
