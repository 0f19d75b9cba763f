"""The client side of a relayed stream: an ASGI response that writes the relay's buffer to the socket.

Owns: the SSE status line and headers, writing each event with a deadline, pings while idle,
noticing the client leave, and deciding how the stream ended (`Ending`). What bytes an internal
event becomes is the surface's `Encoder`; this module only writes them.
Must not: read the worker (relay.py) or release reservations (the `on_end` callback does).

Deliberate deviation from sse-starlette's EventSourceResponse: a slow client must be cut off
without one more byte (the socket is full) and without an exception traceback, and the writer must
race the reader's slow-consumer signal. So on a slow client this response returns without
completing the body; uvicorn then closes the connection (server.py silences its log line for it).

One timer per stream (`_watch`) keeps both the write deadline and the ping interval: a timeout
around every send and every wait would arm and cancel two timers per token.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from typing import Protocol

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from coordinator.clock import Clock
from coordinator.relay import TERMINAL, Relay
from protocol.sse import PING, SseEvent, encode
from protocol.worker import EVENT_TOKEN

log = logging.getLogger("coordinator")
_PING = SseEvent("", "")  # queued by the stream's timer when it has been quiet; sent as an SSE comment


class Encoder(Protocol):
    """A surface's wire format for one stream: the bytes each internal event becomes (a terminal
    event's bytes end the body, so they carry any closing frame the format needs)."""

    def __call__(self, event: SseEvent) -> bytes: ...


def passthrough(event: SseEvent) -> bytes:
    """The internal event as it came from the worker (the `/coordinator/infer` surface's format)."""
    return encode(event.event, event.data)


class Ending(enum.Enum):
    COMPLETE = "complete"  # the done or error event reached the client
    CLIENT_GONE = "client_gone"
    SLOW_CLIENT = "slow_client"
    INTERNAL = "internal"  # the writer itself failed: a bug, logged with its traceback


class _SendTimeout(Exception):
    pass


class RelayResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, relay: Relay, *, headers: dict[str, str], ping_interval: float, clock: Clock,
                 on_end: Callable[[Ending], None], encoder: Encoder = passthrough) -> None:
        super().__init__(content=None, status_code=200,
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        # Response.__init__ adds `content-length: 0` for a bodiless response; a stream must not have one.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.relay = relay
        self.ping_interval = ping_interval
        self.clock = clock
        self.on_end = on_end
        self.encoder = encoder
        self._sending_since: float | None = None  # loop time the writer's send in progress began
        self._send_timed_out = False
        self._last_sent_at = 0.0  # loop time the last send began
        self._watchdog: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ending = Ending.CLIENT_GONE
        loop = asyncio.get_running_loop()
        writer = asyncio.create_task(self._write(send))  # first: the first event is already queued
        reader = asyncio.create_task(self.relay.run())
        client_left = asyncio.create_task(client_left_of(receive))
        self._last_sent_at = loop.time()
        self._watchdog = loop.call_later(min(self.relay.write_deadline, self.ping_interval), self._watch, writer)
        try:
            await self._first_to_end(writer, client_left, reader)
            fault = writer.exception() if writer.done() and not writer.cancelled() else None
            if writer.done() and not writer.cancelled() and fault is None:
                ending = Ending.COMPLETE
            elif self._send_timed_out or self.relay.slow:
                ending = Ending.SLOW_CLIENT
            elif fault is not None:
                ending = Ending.INTERNAL
                log.error(json.dumps({"event": "internal_error", "task": "relay_writer",
                                      "request_id": self.relay.request_id, "error": repr(fault)}), exc_info=fault)
            if ending is Ending.COMPLETE:
                # End the client's response first: the reader may still be reading the worker's last bytes.
                await self._end_body(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except _SendTimeout:
            pass  # every event was delivered; uvicorn closes the connection we could not finish
        finally:
            self._watchdog.cancel()
            writer.cancel()
            client_left.cancel()
            if ending is not Ending.COMPLETE:
                reader.cancel()  # closes the worker response: the worker cancels and frees the KV
            await asyncio.gather(reader, writer, client_left, return_exceptions=True)
            self.on_end(ending)

    async def _first_to_end(self, writer: asyncio.Task[None], client_left: asyncio.Task[None],
                            reader: asyncio.Task[None]) -> None:
        """Returns when the writer ends, the client leaves, or the reader gives up on a slow client
        (the reader ending normally only means the whole worker stream is queued: the writer goes on).
        Done-callbacks on one future: lighter than `asyncio.wait`, and every open stream holds this wait."""
        ended = asyncio.get_running_loop().create_future()

        def end(task: asyncio.Task[None]) -> None:
            if not ended.done() and (task is not reader or self.relay.slow):
                ended.set_result(None)

        for task in (writer, client_left, reader):
            task.add_done_callback(end)
        try:
            await ended
        finally:
            for task in (writer, client_left, reader):
                task.remove_done_callback(end)

    async def _write(self, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        queue = self.relay.queue
        while True:
            event = await queue.get()
            if event is _PING:
                await self._send(send, _body(PING))
                continue
            await self._send(send, _body(self.encoder(event)))
            if event.event == EVENT_TOKEN and self.relay.outcome.first_token_at is None:
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
            raise _SendTimeout from None



async def client_left_of(receive: Receive) -> None:
    """Returns when the client has gone (the only message a request whose body was read gets)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}
