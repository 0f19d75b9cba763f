"""The non-streaming side of a relayed request: read the whole stream, then answer one JSON body.

Owns: draining the relay's buffer as fast as the worker fills it, noticing the client leave while it
waits, and sending the surface's single response (which may still be an HTTP error: no byte has
been sent before the stream ends, so a failure mid-generation becomes a status code, not an event).
Must not: read the worker (relay.py) or shape the body (the surface's `assemble` does).

Bounded: the stream holds at most `max_tokens` token events, which the request's validation bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coordinator.relay import TERMINAL, Relay
from coordinator.response import Ending, client_left_of
from protocol.sse import SseEvent
from protocol.worker import EVENT_TOKEN

Assemble = Callable[[list[SseEvent]], Response]


class CollectedResponse(Response):
    def __init__(self, relay: Relay, *, assemble: Assemble, on_end: Callable[[Ending], None],
                 now: Callable[[], float]) -> None:
        super().__init__(content=None, status_code=200)
        self.relay = relay
        self.assemble = assemble
        self.on_end = on_end
        self.now = now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ending = Ending.CLIENT_GONE
        reader = asyncio.create_task(self.relay.run())
        collector = asyncio.create_task(self._collect())
        client_left = asyncio.create_task(client_left_of(receive))
        try:
            await asyncio.wait((collector, client_left), return_when=asyncio.FIRST_COMPLETED)
            if collector.done() and not collector.cancelled() and collector.exception() is None:
                response = self.assemble(collector.result())
                async with asyncio.timeout(self.relay.write_deadline):
                    await response(scope, receive, send)
                ending = Ending.COMPLETE
        except TimeoutError:
            ending = Ending.SLOW_CLIENT
        finally:
            collector.cancel()
            client_left.cancel()
            if ending is not Ending.COMPLETE:
                reader.cancel()  # closes the worker response: the worker cancels and frees the KV
            await asyncio.gather(reader, collector, client_left, return_exceptions=True)
            self.on_end(ending)

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
