"""The worker's Server-Sent-Event response: events arrive already encoded and go straight to the server.

Owns: the response head, keep-alive pings while no event is being written (so the coordinator's read
timeout sees a live stream through a long prefill), the bound on one blocked write (a client that
stops reading is cut after `send_timeout`), and ending the stream when the client disconnects.
Must not: make events (app.py's `_events` does, and its `finally` cancels the job) or touch the engine.

Why not sse-starlette, which this replaced: per event it built a `ServerSentEvent`, encoded it through
a `StringIO` and opened an anyio cancel scope for the write's timeout. Here an event is one `bytes`
object and one ASGI message; the write's deadline is checked by the ping task once a ping interval,
not armed and disarmed per event. On the tiny model at 64 streams the worker's HTTP/SSE threads went
from about 140-155 to 48-66 us of CPU a token (docs/benchmarks.md, "The HTTP side's cost per token").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from protocol.sse import encode
from protocol.worker import EVENT_TOKEN

PING = b": ping\r\n\r\n"
_HEAD = {"cache-control": "no-store", "x-accel-buffering": "no"}


def token_event(text: str, index: int, probability: float | None, choice: int = 0,
                top: tuple[tuple[str, float], ...] = (), ids: list[int] | None = None) -> bytes:
    """`protocol.worker.TokenEvent`'s JSON, written without building the model: it is the one event
    sent per generated token. `probability` None: not asked for (null). `choice` 0 is left out, as
    the model leaves it out; so are `top` when empty (no alternatives asked for) and `ids` when None
    (no `token_ids` asked for)."""
    if probability is None:
        p = "null"
    elif 0.0 <= probability <= 1.0:
        p = repr(float(probability))
    else:
        raise ValueError(f"probability {probability!r} is not in [0, 1]")
    tail = "}" if ids is None else f',"ids":[{",".join(str(int(t)) for t in ids)}]}}'
    if choice:
        tail = f',"choice":{int(choice)}' + tail
    if top:
        tail = f',"top":{json.dumps([[t, float(lp)] for t, lp in top], ensure_ascii=False)}' + tail
    return encode(EVENT_TOKEN, f'{{"token":{json.dumps(text, ensure_ascii=False)},"index":{int(index)},'
                               f'"probability":{p},"finished":false' + tail)


class EventStream(StreamingResponse):
    """A response streaming `events` (each one or more whole SSE events). A Starlette response, so
    FastAPI passes it through; only `__call__` differs from `StreamingResponse`'s."""

    def __init__(self, events: AsyncGenerator[bytes, None], *, headers: Mapping[str, str], ping_interval: float,
                 send_timeout: float) -> None:
        super().__init__(events, headers={**_HEAD, **headers}, media_type="text/event-stream")
        self._events = events
        self._ping_interval = ping_interval
        self._send_timeout = send_timeout
        self._writing_since: float | None = None  # set while one write is in progress
        self._last_write = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._last_write = loop.time()
        writer = asyncio.ensure_future(self._write(send, loop))
        watchers = [asyncio.ensure_future(self._client_gone(receive)),
                    asyncio.ensure_future(self._ping(send, loop))]
        try:
            await asyncio.wait([writer, *watchers], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client went away, or a write outlived its deadline (or this task was cancelled):
            # the writer is cancelled, which closes `events` and so cancels the job.
            for task in (writer, *watchers):
                task.cancel()
            await asyncio.gather(writer, *watchers, return_exceptions=True)
        if writer.done() and not writer.cancelled() and (error := writer.exception()) is not None:
            raise error

    async def _write(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        async with contextlib.aclosing(self._events) as events:
            async for chunk in events:
                self._writing_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._writing_since = None
                self._last_write = loop.time()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _client_gone(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _ping(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        """Returns (ending the stream) when a write has been blocked past the send timeout."""
        while True:
            await asyncio.sleep(self._ping_interval)
            now = loop.time()
            since = self._writing_since
            if since is not None:
                if now - since > self._send_timeout:
                    return
            elif now - self._last_write >= self._ping_interval:
                self._last_write = now
                try:
                    async with asyncio.timeout(self._send_timeout):  # a ping blocked as long cuts it too
                        await send({"type": "http.response.body", "body": PING, "more_body": True})
                except TimeoutError:
                    return
