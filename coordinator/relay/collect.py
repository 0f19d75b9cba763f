"""The non-streaming side of a relayed request: read the whole stream, then answer one JSON body.

Owns: draining the relay's buffer as fast as the worker fills it and sending the surface's single
response (which may still be an HTTP error: no byte has been sent before the stream ends, so a
failure mid-generation becomes a status code, not an event). The supervisor (supervisor.py) runs it
with the same ending rules as a streamed answer: the client leaving, a slow client, and a fault of
its own, which the client hears as the surface's 500 error body.
Must not: read the worker (stream.py) or shape the body (the surface's `assemble` does).

Bounded: the stream holds at most `n` x `max_tokens` token events (every choice's), which the
request's validation bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from coordinator.relay.stream import TERMINAL, Relay
from coordinator.relay.supervisor import Ending, SendTimeout, SupervisedResponse
from protocol.sse import SseEvent
from protocol.worker import EVENT_TOKEN

Assemble = Callable[[list[SseEvent]], Response]


class CollectedResponse(SupervisedResponse):
    task = "collector"

    def __init__(self, relay: Relay, *, assemble: Assemble, on_end: Callable[[Ending], None],
                 now: Callable[[], float]) -> None:
        super().__init__(relay, on_end=on_end)
        self.assemble = assemble
        self.now = now
        self._head_sent = False

    async def consume(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.assemble(await self._collect())
        try:
            async with asyncio.timeout(self.relay.write_deadline):
                await response(scope, receive, self._tracked(send))
        except TimeoutError:
            raise SendTimeout from None

    async def fail(self, scope: Scope, receive: Receive, send: Send, error: SseEvent) -> None:
        """The surface's own error body for an `internal` error (its `assemble` maps an error event to
        one); a plain JSON 500 if that fails too. Nothing can be said once the answer has started."""
        if self._head_sent:
            return
        try:
            response = self.assemble([error])
        except Exception:  # noqa: BLE001 - the assembler may be what failed
            response = JSONResponse({"error": "internal error", "reason": "internal",
                                     "request_id": self.relay.request_id}, status_code=500)
        await response(scope, receive, send)

    def _tracked(self, send: Send) -> Send:
        async def tracked(message: Message) -> None:
            self._head_sent = True
            await send(message)

        return tracked

    async def _collect(self) -> list[SseEvent]:
        events: list[SseEvent] = []
        queue, outcome = self.relay.queue, self.relay.outcome
        while True:
            event = await queue.get()
            if not event.event:
                continue  # a ping: nothing to collect
            if event.event == EVENT_TOKEN and outcome.first_token_at is None:
                outcome.first_token_at = self.now()
            events.append(event)
            if event.event in TERMINAL:
                return events
