"""A stream of several choices continued as one-choice streams: choice i's continuation on its own
worker (relay/continuation.py places each), their events read as the one stream the relay expects.

Owns: reading the continuations side by side, each token event relabelled with its choice (`choice`;
the event otherwise as its worker wrote it), each continuation's reservation given back when its
`done` came (its worker succeeded) or when the stream is left (no verdict), and the one final `done`
the worker of an n-choice request would have sent: every choice's ending in choice order
(`DoneEvent.choices`), the usage summed (the prompt once), `cancelled` if any choice was, else `length`
if any ran out of tokens, else `stop` (worker/engine/endings.py's `combined`). A continuation that
breaks, or ends with an `error`, ends them all (its error event passed on, `broken` naming it), as a
failing choice fails the request on a worker; its reader may continue them again, or give up.
Must not: place anything or judge the broken worker (the `Continuing` that reads it does both).

Timings of the final `done`: the continuations ran side by side, so the first's queue and prefill, the
soonest first token, the latest end, and their rates summed; a choice that had ended before (a choice
of an earlier merge, or one whose ids had reached `max_tokens`) adds its tokens and no time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from coordinator.relay.dispatch import OpenStream
from coordinator.upstream import WorkerStreamError
from protocol.sse import SseEvent
from protocol.worker import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_TOKEN,
    ChoiceEnd,
    DoneEvent,
    FinishReason,
    Timings,
    Usage,
)

# A continuation given back: its reservation, and whether its worker finished it (its `done` came).
Leave = Callable[[OpenStream, bool], None]


@dataclass(slots=True)
class _Reading:
    """One choice's continuation, as far as it has been read."""

    stream: OpenStream
    events: AsyncIterator[SseEvent]
    done: DoneEvent | None = None
    left: bool = False  # given back (`Leave`) and closed


class Choices:
    """The continuations of a stream's choices (`placing`: each choice's placement, by choice), read as one
    stream of `n` choices, each as soon as it is placed (one placed streams on, and frees its worker's room
    when it ends, while another waits for room); `ended`: the choices that need none, and how each ended
    (it grows as the others end). `leave` runs once for each continuation but the broken one;
    `prompt_tokens` is the usage's when no continuation counted it (none was needed), `continued` the
    stream they continue (given back already). A placement that failed raises its `CoordinatorError`
    from `events`."""

    __slots__ = ("_iterator", "_placing", "_reading", "broken", "continued", "ended", "last", "leave", "n",
                 "prompt_tokens", "request_id")

    def __init__(self, placing: Mapping[int, asyncio.Future[OpenStream]], ended: dict[int, ChoiceEnd], *, n: int,
                 request_id: str, prompt_tokens: int, leave: Leave, continued: OpenStream) -> None:
        self.ended = ended
        self.n = n
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.leave = leave
        self.continued = continued
        self.broken: OpenStream | None = None  # the continuation that broke or failed the stream, if one did
        self._placing = dict(sorted(placing.items()))
        self._reading: dict[int, _Reading] = {}  # the continuations placed, by choice
        # The continuation whose event was read last (whose `done` completed it, or that broke it); the
        # stream they continue until one is read, or when one could not be placed.
        self.last = continued
        self._iterator: AsyncGenerator[SseEvent, None] | None = None

    async def placed(self) -> str:
        """The worker a first choice's continuation went to, once one is placed ("" when none was needed);
        the `CoordinatorError` of a placement that failed first (then every continuation given back)."""
        if not self._placing:
            return ""
        try:
            finished, _ = await asyncio.wait(self._placing.values(), return_when=asyncio.FIRST_COMPLETED)
            failure = next((e for task in finished if (e := task.exception()) is not None), None)
            if failure is not None:
                raise failure
        except BaseException:
            self.last = self.continued
            await self._settle(())
            raise
        return next(iter(finished)).result().worker.worker_id

    @property
    def events(self) -> AsyncGenerator[SseEvent, None]:
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def close(self) -> None:
        """Every continuation not given back yet is, and closed (its worker cancels it), a placement still
        running cancelled; not `broken`, which its reader judges and gives back."""
        if self._iterator is not None:
            await self._iterator.aclose()
        await self._settle(())
        if self.broken is not None:
            await self.broken.close()

    async def _events(self) -> AsyncGenerator[SseEvent, None]:
        pending: dict[asyncio.Future[Any], int] = {task: choice for choice, task in self._placing.items()}
        try:
            while pending:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(finished, key=pending.__getitem__):
                    choice = pending.pop(task)
                    if choice not in self._reading:
                        self._placed(choice, task)
                    elif (event := self._read(choice, task)) is not None:
                        yield event
                        if event.event == EVENT_ERROR:
                            return
                    reading = self._reading[choice]
                    if reading.left:
                        await reading.stream.close()  # read to its end: the connection back to the pool
                    else:
                        pending[asyncio.ensure_future(_next(reading.events))] = choice
            yield self._done()
        finally:
            await self._settle(pending)

    def _placed(self, choice: int, task: asyncio.Future[OpenStream]) -> None:
        """Choice `choice`'s continuation placed, to be read; or the `CoordinatorError` that says why not."""
        failure = task.exception()
        if failure is not None:
            self.last = self.continued  # the stream that broke ends it, not one that ran well
            raise failure
        stream = task.result()
        self._reading[choice] = _Reading(stream, with_first(stream.first, stream.events))

    async def _settle(self, pending: Iterable[asyncio.Future[Any]]) -> None:
        """Reads and placements still `pending` cancelled, then every continuation given back (a
        placement that ended meanwhile too)."""
        running = [*pending, *(task for task in self._placing.values() if not task.done())]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for choice, task in self._placing.items():
            if choice not in self._reading and not task.cancelled() and task.exception() is None:
                stream = task.result()
                self._reading[choice] = _Reading(stream, with_first(stream.first, stream.events))
        await self._leave_all()

    def _read(self, choice: int, task: asyncio.Future[SseEvent | None]) -> SseEvent | None:
        """The event to pass on for what choice `choice`'s continuation sent (None: nothing to pass);
        a break raises `WorkerStreamError`, `broken` naming it."""
        reading = self._reading[choice]
        self.last = reading.stream
        try:
            event = task.result()
        except WorkerStreamError:
            if reading.done is None:
                self.broken = reading.stream
                raise
            event = None  # it broke after its done: it ended all the same
        if event is None:
            if reading.done is None:
                self.broken = reading.stream
                raise WorkerStreamError("the worker's stream ended without a done event")
            reading.left = True  # its body read to the end
            self.leave(reading.stream, True)
            return None
        if reading.done is not None:
            return None  # nothing follows a done but the body's end
        if event.event == EVENT_TOKEN:
            return _relabelled(event, choice)
        if event.event == EVENT_DONE:
            reading.done = DoneEvent.model_validate_json(event.data)
            self.ended[choice] = ChoiceEnd(finish_reason=reading.done.finish_reason,
                                           completion_tokens=reading.done.usage.completion_tokens)
            return None
        if event.event == EVENT_ERROR:
            self.broken = reading.stream
        return event

    def _done(self) -> SseEvent:
        """The stream's final event, once every choice has ended."""
        ends = [self.ended[choice] for choice in range(self.n)]
        dones = [reading.done for reading in self._reading.values() if reading.done is not None]
        seen = {end.finish_reason for end in ends}
        reason: FinishReason = "cancelled" if "cancelled" in seen else "length" if "length" in seen else "stop"
        completion = sum(end.completion_tokens for end in ends)
        prompt = dones[0].usage.prompt_tokens if dones else self.prompt_tokens
        cached = min((done.usage.cached_tokens for done in dones), default=0)
        worker = self.last.worker
        done = DoneEvent(
            finish_reason=reason, usage=Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                                              total_tokens=prompt + completion),
            timings=_side_by_side([done.timings for done in dones]), request_id=self.request_id,
            worker_id=worker.worker_id, model=dones[-1].model if dones else worker.model, choices=ends)
        return SseEvent(EVENT_DONE, done.model_dump_json())

    async def _leave_all(self) -> None:
        for reading in self._reading.values():
            if reading.left or reading.stream is self.broken:
                continue
            reading.left = True
            self.leave(reading.stream, reading.done is not None)
            await reading.stream.close()


def _side_by_side(timings: list[Timings]) -> Timings:
    """The timings of continuations that ran side by side: the first's queue and prefill, the soonest first
    token, the latest end, their rates summed (zeros when none ran)."""
    if not timings:
        return Timings(queue_ms=0, prefill_ms=0, ttft_ms=0, total_ms=0, tokens_per_second=0)
    return Timings(queue_ms=timings[0].queue_ms, prefill_ms=timings[0].prefill_ms,
                   ttft_ms=min(t.ttft_ms for t in timings), total_ms=max(t.total_ms for t in timings),
                   tokens_per_second=sum(t.tokens_per_second for t in timings))


def _relabelled(event: SseEvent, choice: int) -> SseEvent:
    """A one-choice continuation's token event as choice `choice`'s (`TokenEvent.choice`, left out for 0)."""
    if choice == 0:
        return event
    return SseEvent(event.event, orjson.dumps({**orjson.loads(event.data), "choice": choice}).decode())


async def _next(events: AsyncIterator[SseEvent]) -> SseEvent | None:
    return await anext(events, None)


async def with_first(first: SseEvent, events: AsyncIterator[SseEvent]) -> AsyncIterator[SseEvent]:
    """A worker stream's events from its first (read when it was placed), then the rest."""
    yield first
    async for event in events:
        yield event
