"""The client side of a relayed stream: an ASGI response that writes the relay's buffer to the socket.

Owns: the SSE status line and headers, writing each event with a deadline, pings while idle, and
the `error` event a client gets when writing itself failed. What bytes an internal event becomes is
the surface's `Encoder`; this module only writes them. How a stream ends (`Ending`), the client
leaving and the call to `on_end` are the supervisor's (supervisor.py), shared with collect.py.
Must not: read the worker (stream.py) or release reservations (the `on_end` callback does).

Deliberate deviation from sse-starlette's EventSourceResponse: a slow client must be cut off
without one more byte (the socket is full) and without an exception traceback, and the writer must
race the reader's slow-consumer signal. So on a slow client this response returns without
completing the body; uvicorn then closes the connection (server.py silences its log line for it).

One timer per stream (`_watch`) keeps both the write deadline and the ping interval: a timeout
around every send and every wait would arm and cancel two timers per token.

Events that are already waiting in the buffer when the writer takes one go out with it in one send
(at most `COALESCE_EVENTS`): a send is a system call, and the largest part of the relay's CPU per
token. Nothing waits to be coalesced, so a token is never later for it; events pile up only when the
writer is behind (the coordinator's core busy, or the client's socket slow), and that is when one
write for several of them saves the most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from starlette.types import Message, Receive, Scope, Send

from coordinator.clock import Clock
from coordinator.relay.stream import TERMINAL, Relay
from coordinator.relay.supervisor import Ending, SendTimeout, SupervisedResponse
from protocol.sse import PING, SseEvent, encode
from protocol.worker import EVENT_TOKEN

_PING = SseEvent("", "")  # queued by the stream's timer when it has been quiet; sent as an SSE comment
COALESCE_EVENTS = 32  # events written in one send, at most


class Encoder(Protocol):
    """A surface's wire format for one stream: the bytes each internal event becomes (a terminal
    event's bytes end the body, so they carry any closing frame the format needs)."""

    def __call__(self, event: SseEvent) -> bytes: ...


def passthrough(event: SseEvent) -> bytes:
    """The internal event as it came from the worker (the `/coordinator/infer` surface's format)."""
    return encode(event.event, event.data)


class RelayResponse(SupervisedResponse):
    media_type = "text/event-stream"
    task = "relay_writer"

    def __init__(self, relay: Relay, *, headers: dict[str, str], ping_interval: float, clock: Clock,
                 on_end: Callable[[Ending], None], encoder: Encoder = passthrough) -> None:
        super().__init__(relay, on_end=on_end,
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        # Response.__init__ adds `content-length: 0` for a bodiless response; a stream must not have one.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.ping_interval = ping_interval
        self.clock = clock
        self.encoder = encoder
        self._sending_since: float | None = None  # loop time the writer's send in progress began
        self._send_timed_out = False
        self._head_sent = False
        self._last_sent_at = 0.0  # loop time the last send began
        self._watchdog: asyncio.TimerHandle | None = None

    def watch(self, consumer: asyncio.Task[None]) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        self._last_sent_at = loop.time()
        self._watchdog = loop.call_later(min(self.relay.write_deadline, self.ping_interval), self._watch, consumer)
        return lambda: self._watchdog.cancel() if self._watchdog is not None else None

    def slow(self) -> bool:
        return self._send_timed_out

    async def consume(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._write(send)

    async def complete(self, send: Send) -> None:
        # End the client's response first: the reader may still be reading the worker's last bytes.
        await self._end_body(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def fail(self, scope: Scope, receive: Receive, send: Send, error: SseEvent) -> None:
        """An `error` event in the surface's format when the stream has started (the raw internal
        event if the encoder is what failed), else a 500 with the internal event's JSON."""
        if not self._head_sent:
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": error.data.encode(), "more_body": False})
            return
        try:
            body = self.encoder(error)
        except Exception:  # noqa: BLE001 - the encoder is what failed: the event as the worker writes it
            body = passthrough(error)
        await send(_body(body))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _write(self, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        self._head_sent = True
        queue = self.relay.queue
        while True:
            event = await queue.get()
            if event is _PING:
                await self._send(send, _body(PING))
                continue
            events = [event, *queue.take(COALESCE_EVENTS - 1)] if queue.qsize() else [event]
            chunks: list[bytes] = []
            try:
                for event in events:
                    if event is not _PING:  # a ping among events is not needed: they are sent now
                        chunks.append(self.encoder(event))
                    if event.event in TERMINAL:
                        break
            finally:
                # The events encoded before an encoder fault still reach the client, in order, before
                # the error the supervisor then sends (what the encoders' own rollback assumes).
                if chunks:
                    await self._send(send, _body(b"".join(chunks)))
            if self.relay.outcome.first_token_at is None and any(e.event == EVENT_TOKEN for e in events):
                self.relay.outcome.first_token_at = self.clock.monotonic()
            if event.event in TERMINAL:
                return

    async def _send(self, send: Send, message: Message) -> None:
        """One write from the writer task, watched by `_watch` instead of a timeout of its own, which
        would arm and cancel a timer for every token."""
        self._sending_since = since = asyncio.get_running_loop().time()
        await send(message)
        self._sending_since = None
        self._last_sent_at = since

    def _watch(self, writer: asyncio.Task[None]) -> None:
        """The one timer of a stream. Cancels the writer once a send has waited `write_deadline`;
        queues a ping when nothing was sent for `ping_interval`; then looks again when either could
        next be due."""
        loop = asyncio.get_running_loop()
        deadline, now, since = self.relay.write_deadline, loop.time(), self._sending_since
        if since is not None:
            if now - since >= deadline:
                self._send_timed_out = True
                writer.cancel()
                return
            self._watchdog = loop.call_at(since + deadline, self._watch, writer)
            return
        if now - self._last_sent_at >= self.ping_interval:
            self.relay.queue.put_nowait(_PING)  # refused when full: then there are events to send anyway
            self._last_sent_at = now
        self._watchdog = loop.call_at(min(self._last_sent_at + self.ping_interval, now + deadline), self._watch, writer)

    async def _end_body(self, send: Send, message: Message) -> None:
        try:
            async with asyncio.timeout(self.relay.write_deadline):
                await send(message)
        except TimeoutError:
            raise SendTimeout from None


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}
