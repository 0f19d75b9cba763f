"""Server-Sent Events from lines: httpx's `aiter_lines` gives whole lines; this turns them into events.

Owns: the SSE field rules the two stream formats use (`event:`, `data:`, comments, blank-line ends).
Must not: interpret payloads (clients.py does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str
    data: str


class SseLines:
    """Feed it one line at a time (without its line ending); it returns the event a blank line ends."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> SseEvent | None:
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None  # a comment: keep-alive pings
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None  # `id:` and `retry:` mean nothing to a load test

    def flush(self) -> SseEvent | None:
        """The pending event, if any: also called when the stream ends without a final blank line."""
        event = SseEvent(self._event or "message", "\n".join(self._data)) if self._data else None
        self._event, self._data = "", []
        return event
