"""Serving the app with uvicorn: a bounded send buffer on every client connection, and an event
stream's head sent in the same segment as its first event.

Owns: the uvicorn protocol class and the log filter that go with the relay's slow-client cut-off.
Must not: build the app or read settings beyond what it is given.

Why bound the send buffer: a client that stops reading should fill its relay buffer (where the
write deadline sees it) within a few dozen events. Left alone, Linux autotunes a loopback socket's
send buffer to megabytes and asyncio's transport holds 64 KiB more, so thousands of tokens would
vanish into buffers before the coordinator noticed. SSE token events are ~100 bytes, so 32 KiB is
plenty for a reading client.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools is a dependency

from serving.edge import EdgeLimits, guarded_protocol


class _CoalescingTransport:
    """Holds an event-stream response's head until its next write, so one TCP segment carries the
    status line, the headers and the first token: the client wakes once for its first token instead
    of twice (measured: about 0.5 ms of time to first token on this project's 2-core machine).
    Safe because the coordinator's only event stream (response.py) sends its head only once its
    first event is in hand and writes that event right after."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        elif data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data:
            self._held = data
            return
        self._transport.write(data)

    def close(self) -> None:
        if self._held:
            self._transport.write(self._held)
            self._held = b""
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_protocol(send_buffer_bytes: int, limits: EdgeLimits | None = None) -> type[asyncio.Protocol]:
    """The coordinator's protocol: this send buffer, and the edge limits (serving/edge.py) when given."""

    class BoundedSendProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]  # a proxy
            if send_buffer_bytes <= 0:
                return
            sock = transport.get_extra_info("socket")  # the real transport's
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            transport.set_write_buffer_limits(high=send_buffer_bytes)

    return BoundedSendProtocol if limits is None else guarded_protocol(limits, BoundedSendProtocol)


class DropAbandonedResponse(logging.Filter):
    """A slow client's stream is abandoned on purpose (response.py) and logged by the coordinator
    as `slow_consumer`; uvicorn's generic error line for it would only be noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."

