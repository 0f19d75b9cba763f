"""Limits at the edge of both services: what a peer may send before the app sees a request.

Owns: `EdgeLimits` and `guarded_protocol`, a uvicorn httptools protocol that enforces them while it
parses: header bytes and count (431), body bytes (413: from Content-Length at once, or as a chunked
body grows), and deadlines for a request's headers and body to arrive (408), which also ends a
connection that never sends a request (slowloris). A refusal is one JSON error body (the service's
own shape, from `ErrorRender`), then the connection is closed, so the rest of what the peer sends is
never read. Must not: know either service's routes beyond `path_body_limits`.

Why here and not in ASGI middleware: by the time an ASGI app runs, uvicorn has parsed every header
(20 MB of them, if sent), and a body the app never reads is still buffered; a deadline on the
headers cannot be kept from inside the app at all, since the app is called only after them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools is a dependency

from protocol import reasons

# Raw header bytes beyond the counted ones (names and values): each header's ": " and line end, the
# request line's spaces and version. Past the limit plus this, a header section is refused as it
# arrives, before its line ends: the parser buffers an unfinished line whole.
HEADER_FRAMING = 4

# (path, status, reason, message) -> (content type, body)
ErrorRender = Callable[[str, int, str, str], tuple[bytes, bytes]]
PHRASES = {408: b"Request Timeout", 413: b"Content Too Large", 431: b"Request Header Fields Too Large"}


def plain_error(path: str, status: int, reason: str, message: str) -> tuple[bytes, bytes]:
    """The `ErrorBody` shape both services use outside `/v1/`."""
    return b"application/json", json.dumps({"error": message, "reason": reason, "request_id": ""}).encode()


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024  # request line and every header, names and values
    max_headers: int = 100
    header_timeout: float = 10.0  # connection open (or last response sent) to the end of the headers
    body_timeout: float = 30.0  # end of the headers to the end of the body
    path_body_limits: Mapping[str, int] = field(default_factory=dict)  # tighter bounds for some paths
    prefix_body_limits: Mapping[str, int] = field(default_factory=dict)  # other bounds for paths under a prefix
    render: ErrorRender = plain_error


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the response is already written."""


def guarded_protocol(limits: EdgeLimits, base: type[HttpToolsProtocol] = HttpToolsProtocol) -> type[HttpToolsProtocol]:
    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            self._refused = False
            self._timer: asyncio.TimerHandle | None = None
            self._header_bytes = self._header_count = self._body_bytes = 0
            self._in_headers = True  # awaiting (the rest of) a request's header section
            self._raw_header_bytes = 0  # bytes received of that section, before it is parsed
            self._tail = b""  # the last bytes received, for an end of headers split between reads
            self._begun = False  # a byte of the current request arrived
            self._body_limit = limits.max_body_bytes
            super().connection_made(transport)
            self._arm(limits.header_timeout, "the request's headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            over = self._in_headers and self._header_section_over(data)
            super().data_received(data)  # one read: bounded by the transport's read size
            if over and self._in_headers and not self._refused:
                self._respond(431, reasons.HEADERS_TOO_LARGE,
                              f"the request line and headers are over {limits.max_header_bytes} bytes")

        def _header_section_over(self, data: bytes) -> bool:
            """Counts a header section's bytes as they arrive: True once they pass the limit without
            the section ending, however long its current line is (the parser would buffer it whole)."""
            if (self._tail + data).find(b"\r\n\r\n") >= 0:
                return False  # it ends in this read: the parser counts it exactly
            self._raw_header_bytes += len(data)
            self._tail = (self._tail + data)[-3:]
            return self._raw_header_bytes > limits.max_header_bytes + HEADER_FRAMING * (limits.max_headers + 1)

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # after our own refusal the parser reports our exception as a 400
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            """The first byte of a request (the next one, on a kept-alive connection): its headers'
            deadline starts now. Between requests uvicorn's keep-alive timeout closes an idle connection."""
            self._header_bytes = self._header_count = self._body_bytes = 0
            self._begun = True
            self._arm(limits.header_timeout, "the request's headers")
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > limits.max_headers:
                self._refuse(431, reasons.HEADERS_TOO_LARGE, f"more than {limits.max_headers} headers")
            self._count_header_bytes(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_headers = False
            path = self.url.split(b"?", 1)[0].decode("latin-1")
            self._body_limit = limits.path_body_limits.get(path, next(
                (bound for prefix, bound in limits.prefix_body_limits.items() if path.startswith(prefix)),
                limits.max_body_bytes))
            length = next((v for k, v in self.headers if k == b"content-length"), None)
            if length is not None and length.strip().isdigit() and int(length) > self._body_limit:
                self._refuse(413, reasons.BODY_TOO_LARGE,
                             f"the body is {int(length)} bytes; at most {self._body_limit} are accepted here")
            super().on_headers_complete()
            if length is not None and length.strip() not in (b"", b"0") or any(
                    k == b"transfer-encoding" for k, _ in self.headers):
                self._arm(limits.body_timeout, "the request's body")

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            if self._body_bytes > self._body_limit:
                self._refuse(413, reasons.BODY_TOO_LARGE, f"the body is over {self._body_limit} bytes")
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_headers, self._raw_header_bytes, self._tail, self._begun = True, 0, b"", False
            super().on_message_complete()

        def _count_header_bytes(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > limits.max_header_bytes:
                self._refuse(431, reasons.HEADERS_TOO_LARGE,
                             f"the request line and headers are over {limits.max_header_bytes} bytes")

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, seconds, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, seconds: float, what: str) -> None:
            self._timer = None
            cycle = self.cycle
            if cycle is not None and cycle.response_started:
                if cycle.response_complete:
                    self._close()  # answered early, and the rest of the body never came: nothing to say
                return  # still answering: its response decides the connection's fate
            if not self._begun and self._raw_header_bytes == 0 and cycle is None:
                self._close()  # nothing was ever sent: no one to tell
                return
            self._respond(408, reasons.REQUEST_TIMEOUT, f"{what} did not arrive within {seconds:g} s")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._respond(status, reason, message)
            raise _Refused(message)

        def _respond(self, status: int, reason: str, message: str) -> None:
            if self._refused:
                return
            path = self.url.split(b"?", 1)[0].decode("latin-1") if self.url else ""
            content_type, body = limits.render(path, status, reason, message)
            head = (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                    % (status, PHRASES[status], content_type, len(body)))
            self.transport.write(head + body)
            self._close()
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app, if it started, must not answer too
                self.cycle.message_event.set()

        def _close(self) -> None:
            self._refused = True
            self._disarm()
            self.transport.close()

    return GuardedProtocol
