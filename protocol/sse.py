"""Server-Sent Events on the wire, for every reader and writer of the project's streams.

Owns: turning arbitrary network reads into whole events (an event, a line, a `\\r\\n` pair or a
UTF-8 character may be split across reads) and turning events back into bytes. Used by the
coordinator (worker streams in, client streams out), the load tool and the tests.
Must not: interpret event payloads or do I/O.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_EOL = re.compile(r"\r\n|\r|\n")
PING = b": ping\r\n\r\n"


class SseTooLarge(ValueError):
    """One event grew past the parser's bound: the stream is not one we can relay."""


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str
    data: str


class SseParser:
    """Feed it bytes as they arrive; it returns the events those bytes completed."""

    def __init__(self, max_event_chars: int = 1 << 20) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._event = ""
        self._data: list[str] = []
        self._size = 0
        self._max = max_event_chars

    def feed(self, chunk: bytes) -> list[SseEvent]:
        text = self._pending + self._decoder.decode(chunk)
        events: list[SseEvent] = []
        if text.count("\r\n") == text.count("\r") == text.count("\n"):
            # Only CRLF line ends (as this project writes them), none split across reads: one split.
            lines = text.split("\r\n")
            self._pending = lines.pop()
            for line in lines:
                self._line(line, events)
        else:
            self._pending = self._lines(text, events)
        if len(self._pending) + self._size > self._max:
            raise SseTooLarge(f"an SSE event exceeded {self._max} characters")
        return events

    def _lines(self, text: str, events: list[SseEvent]) -> str:
        """Every whole line of `text`, any line end (CRLF, CR, LF); returns what follows the last one."""
        start, end = 0, len(text)
        while (m := _EOL.search(text, start)) is not None:
            if m.group() == "\r" and m.end() == end:
                break  # a lone CR at the end may be the first half of CRLF: wait for the next read
            self._line(text[start:m.start()], events)
            start = m.end()
        return text[start:]

    def close(self) -> SseEvent | None:
        """The stream ended: the event still pending if its final blank line never came."""
        events: list[SseEvent] = []
        if self._pending:
            self._line(self._pending, events)
            self._pending = ""
        self._line("", events)
        return events[0] if events else None

    def _line(self, line: str, events: list[SseEvent]) -> None:
        if not line:
            if self._data:
                events.append(SseEvent(self._event or "message", "\n".join(self._data)))
            self._event, self._data, self._size = "", [], 0
            return
        if line.startswith(":"):
            return  # a comment, e.g. the worker's keep-alive ping
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            self._size += len(value)
        # `id` and `retry` mean nothing to the coordinator; unknown fields are ignored per the spec.


def encode(event: str, data: str) -> bytes:
    """One event, CRLF line ends; multi-line data becomes several data lines."""
    if "\n" not in data and "\r" not in data:
        return f"event: {event}\r\ndata: {data}\r\n\r\n".encode()
    lines = "".join(f"data: {line}\r\n" for line in _EOL.split(data))
    return f"event: {event}\r\n{lines}\r\n".encode()
