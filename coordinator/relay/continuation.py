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

Several choices (n > 1): the ids are kept per choice (a token event's `choice`), and a break continues
each choice as a one-choice request of its own (its ids, its seed), read as one stream again
(relay/choices.py); a break of those counts once. A worker says how each choice ended only in its final
`done`, so every choice is continued but one whose ids reached `max_tokens` (it ended: `length`): one
that had stopped stops again at once when greedy or seeded, and an unseeded one draws on, an answer
as valid, whose end the client had not seen. A draining worker's stream of several choices stays
there (`move` leaves it), finishing in place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson

from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics
from coordinator.relay.choices import Choices, with_first
from coordinator.relay.dispatch import OpenStream
from coordinator.upstream import WorkerStreamError
from protocol import reasons
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, ChoiceEnd, ErrorEvent

log = logging.getLogger("coordinator")
# The endings a continuation may mend: the worker (or its engine) failed, or it is stopping.
CONTINUABLE = frozenset({reasons.WORKER_FAILED, reasons.ENGINE_FAILED, reasons.DRAINING})

# Given the choice (0 for a one-choice request), the ids the client has of it, the workers to leave out,
# whether it may wait in the queue for room and a live worker that holds its cells (a draining one: the next
# may fetch them instead of prefilling), the stream that goes on (its worker's first event read), or a
# `CoordinatorError` saying why none took it.
Resume = Callable[[int, list[int], frozenset[str], bool, str | None], Awaitable[OpenStream]]


@dataclass(frozen=True, slots=True)
class Break:
    """Why a worker's stream stopped short of its end (for the log and the client's error event)."""

    worker_id: str
    why: str
    failed: bool = True  # False: its worker drains, or it was a choice's continuation left: it failed nothing
    succeeded: bool = False  # a choice's continuation that ended whole: its worker succeeded


class Continuing:
    """An `Upstream` (relay/stream.py) over a worker's stream that continues on another worker, at most
    `at_most` times, when it breaks after its first token. `left(stream, broke)` runs once for each
    stream it leaves (its reservation back, its worker's breaker told). Each break is counted by how it
    went, and each continuation's pause (from the break to its first event) observed."""

    __slots__ = ("_at_most", "_choices", "_failed", "_ids", "_iterator", "_kept", "_left", "_max_tokens", "_merged",
                 "_metrics", "_move_from", "_not_continued", "_resume", "_stream", "_why_not", "continuations", "first",
                 "request_id")

    def __init__(self, stream: OpenStream, resume: Resume, *, request_id: str, at_most: int,
                 left: Callable[[OpenStream, Break], None], metrics: CoordinatorMetrics,
                 not_continued: str = "", choices: int = 1, max_tokens: int = 0, kept: bool = False) -> None:
        """`not_continued`: why this request is never continued (its error event says so), if it is not.
        `choices`: the request's `n`; `max_tokens`: its own (a choice with that many ids has ended).
        `kept`: a kept session's first turn: continued when its worker fails (the session then lives where
        it went on), never moved off a draining worker, whose drain hands the session over itself."""
        self._stream = stream
        self._merged: Choices | None = None  # its choices' continuations, once a stream of several broke
        self._choices = choices
        self._max_tokens = max_tokens
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
        self._kept = kept
        self._why_not = ""  # why the last break was not continued, for the client's error event
        # The ids the client has been sent of each choice, in order; None once a token event came without
        # them (a worker that was not asked, or cannot tell): such a stream ends as it ends, never continued.
        self._ids: dict[int, list[int]] | None = {i: [] for i in range(choices)} if at_most > 0 else None
        self._note(stream.first)

    @property
    def current(self) -> OpenStream:
        """The worker's stream it reads now; of several choices' continuations, the one read last (whose
        `done` ended it, or that broke it)."""
        return self._merged.last if self._merged is not None else self._stream

    @property
    def events(self) -> AsyncIterator[SseEvent]:
        """One iterator, however often asked: the relay reads the stream's end from where it stopped."""
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def close(self) -> None:
        if self._merged is not None:
            await self._merged.close()
        else:
            await self._stream.close()

    def move(self, worker_id: str) -> None:
        """`worker_id` drains: if this stream runs there, it tries, after its next event, to go on on another
        worker with room (one try, no wait in the queue), and stays where it is when none has; the next
        call (the worker's next heartbeat) tries again. A stream of several choices stays, as does a kept
        session's (the drain moves its session once its turn has ended)."""
        if self._choices == 1 and not self._kept and self.current.worker.worker_id == worker_id:
            self._move_from = worker_id

    async def _events(self) -> AsyncIterator[SseEvent]:
        events = self.current.events
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
                    if self._move_from is not None and (taken := await self._moved(self.current)) is not None:
                        break
                else:
                    broke = "the worker's stream ended without a done event"
            except WorkerStreamError as exc:
                broke = f"the worker's stream broke off: {exc}"
            except CoordinatorError as exc:  # a choice's continuation that no worker took
                self._why_not = f"no other worker could continue it ({exc.reason}: {exc.message})"
                yield self._give_up()
                return
            following = (await self._switch(Break(self.current.worker.worker_id, broke)) if taken is None
                         else with_first(taken.first, taken.events))
            if following is None:
                yield self._give_up()
                return
            events = following

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
            taken = await self._resume(0, list(self._ids[0]), frozenset({*self._failed, worker_id}), False, worker_id)
        except CoordinatorError as exc:
            self._metrics.stream_moves.labels(outcome="stayed").inc()
            log.info(json.dumps({"event": "stream_stays", "request_id": self.request_id, "worker_id": worker_id,
                                 "reason": exc.reason}))
            return None
        self.continuations += 1
        self._left(stream, Break(worker_id, "its worker drains", failed=False))
        await stream.close()
        self._stream = taken
        self._metrics.stream_moves.labels(outcome="moved").inc()
        log.info(json.dumps({"event": "stream_moved", "request_id": self.request_id, "from": worker_id,
                             "to": taken.worker.worker_id, "generated": len(self._ids[0])}))
        return taken

    def _mendable(self, event: SseEvent) -> bool:
        """An error event a continuation may mend (when continuations are left; a kept session's `draining`
        is not: the drain hands its session over)."""
        if self._ids is None or self.continuations >= self._at_most:
            return False
        try:
            reason = ErrorEvent.model_validate_json(event.data).reason
        except ValueError:
            return False
        return reason in CONTINUABLE and not (self._kept and reason == reasons.DRAINING)

    def _note(self, event: SseEvent) -> None:
        """The ids a token event's text covers, added to what the client has of its choice."""
        ids = self._ids
        if ids is None or event.event != EVENT_TOKEN:
            return
        data = orjson.loads(event.data)
        covered = data.get("ids")
        if isinstance(covered, list):
            ids.setdefault(data.get("choice", 0), []).extend(covered)
        else:
            self._ids = None

    async def _switch(self, broke: Break) -> AsyncIterator[SseEvent] | None:
        """The events of the stream that takes over from the broken one, or None (`_why_not` says why)."""
        old, merged = self.current, self._merged
        self._failed.add(broke.worker_id)
        self._left(old, broke)
        await self.close()
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
            if self._choices == 1:
                stream = await self._resume(0, list(self._ids[0]), frozenset(self._failed), True, None)
                self._stream, events, to = stream, with_first(stream.first, stream.events), stream.worker.worker_id
            else:
                self._merged = choices = self._continue_choices(old, self._ids, merged.ended if merged is not None else {})
                events, to = choices.events, await choices.placed()
        except CoordinatorError as exc:
            self._why_not = f"no other worker could continue it ({exc.reason}: {exc.message})"
            log.warning(json.dumps({"event": "continuation_failed", "request_id": self.request_id,
                                    "reason": exc.reason, "error": exc.message}))
            return None
        self._metrics.continuation_pause.observe(time.monotonic() - started)
        self._metrics.stream_breaks.labels(outcome="continued").inc()
        log.info(json.dumps({"event": "stream_continued", "request_id": self.request_id,
                             "from": broke.worker_id, "to": to, "generated": sum(map(len, self._ids.values())),
                             "continuation": self.continuations}))
        return events

    def _continue_choices(self, old: OpenStream, ids: dict[int, list[int]], ended: dict[int, ChoiceEnd]) -> Choices:
        """Each choice not ended yet continued alone, placed side by side (each within CONTINUATION_TIMEOUT),
        read as one stream."""
        ended = dict(ended)
        for choice in range(self._choices):
            if choice not in ended and len(ids.get(choice, ())) >= self._max_tokens:
                ended[choice] = ChoiceEnd(finish_reason="length", completion_tokens=len(ids.get(choice, ())))
        avoid = frozenset(self._failed)
        tasks = {choice: asyncio.ensure_future(self._resume(choice, list(ids.get(choice, ())), avoid, True, None))
                 for choice in range(self._choices) if choice not in ended}
        return Choices(tasks, ended, n=self._choices, request_id=self.request_id,
                       prompt_tokens=self._stream.prompt_tokens or 0, leave=self._leave_choice, continued=old)

    def _leave_choice(self, stream: OpenStream, succeeded: bool) -> None:
        """A choice's continuation given back: it ended whole (`succeeded`), or was left (no verdict)."""
        self._left(stream, Break(stream.worker.worker_id, "its choice ended" if succeeded else "left",
                                 failed=False, succeeded=succeeded))

    def _give_up(self) -> SseEvent:
        """The error event that ends a stream no continuation took, and why none did (what broke is
        logged only: the client gets the reason and a short message)."""
        self._metrics.stream_breaks.labels(outcome="ended").inc()
        message = "the worker's stream broke off before its end"
        if self._why_not:
            message += f", and {self._why_not}"
        return SseEvent(EVENT_ERROR, ErrorEvent(error=message, reason=reasons.WORKER_FAILED,
                                                request_id=self.request_id).model_dump_json())
