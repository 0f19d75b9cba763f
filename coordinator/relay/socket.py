"""The WebSocket side of a relayed stream: the relay's events as text messages on an accepted socket.

Owns: turning a surface's SSE frames (its `Encoder`'s bytes, as for HTTP) into one text message per
event (the event's `data`), sending them through the socket's own send (which the socket serialises
with its other messages) within the relay's write deadline, and the `error` event after a fault of
its own. How the request ends and `on_end` are the supervisor's (supervisor.py), as for HTTP.
Must not: accept, read or close the socket (the surface owns it), or read the worker (stream.py).

No pings: a WebSocket keeps itself alive with its own (uvicorn's, every 20 s). A timeout around each
burst of sends, not the one-timer watch of response.py: a socket stream is one conversation's turn,
not one of thousands of HTTP streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import Receive, Scope, Send

from coordinator.relay.response import Encoder, passthrough
from coordinator.relay.stream import TERMINAL, Relay
from coordinator.relay.supervisor import Ending, SendTimeout, SupervisedResponse
from protocol.sse import SseEvent, SseParser
from protocol.worker import EVENT_TOKEN


def messages_of(frames: bytes) -> list[str]:
    """Each SSE event's data, one message per event (the frames an encoder writes are whole events)."""
    return [event.data for event in SseParser().feed(frames)]


class SocketStream(SupervisedResponse):
    """Called as an ASGI response with the socket's scope and a `receive` that returns
    `http.disconnect` once the client has gone; `send_text` writes one message to the socket."""

    task = "socket_writer"

    def __init__(self, relay: Relay, *, on_end: Callable[[Ending], None], encoder: Encoder,
                 send_text: Callable[[str], Awaitable[None]], now: Callable[[], float]) -> None:
        super().__init__(relay, on_end=on_end)
        self.encoder = encoder
        self.send_text = send_text
        self.now = now

    async def consume(self, scope: Scope, receive: Receive, send: Send) -> None:
        queue, outcome = self.relay.queue, self.relay.outcome
        while True:
            event = await queue.get()
            if not event.event:
                continue  # a ping
            await self._send(self.encoder(event))
            if event.event == EVENT_TOKEN and outcome.first_token_at is None:
                outcome.first_token_at = self.now()
            if event.event in TERMINAL:
                return

    async def fail(self, scope: Scope, receive: Receive, send: Send, error: SseEvent) -> None:
        try:
            frames = self.encoder(error)
        except Exception:  # noqa: BLE001 - the encoder is what failed: the event as the worker writes it
            frames = passthrough(error)
        await self._send(frames)

    async def _send(self, frames: bytes) -> None:
        try:
            async with asyncio.timeout(self.relay.write_deadline):
                for message in messages_of(frames):
                    await self.send_text(message)
        except TimeoutError:
            raise SendTimeout from None
