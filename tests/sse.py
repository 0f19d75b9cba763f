"""A small SSE client for tests: posts a request and collects (event, data) pairs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from protocol.sse import SseParser

# A Python exception's name, as `repr(exc)` or `f"{type(exc).__name__}: ..."` would put it in a message.
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(?:Error|Exception)\b")


def check_error_event(data: dict[str, Any]) -> None:
    """An `error` event carries a reason code and a short message of ours; an exception's text goes to
    the log (every test that reads a stream through `generate` holds both services to it)."""
    assert data.get("reason"), data
    assert not EXCEPTION_NAME.search(data.get("error", "")), f"an exception's text reached a client: {data}"


@dataclass
class Stream:
    status: int
    headers: dict[str, str]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    body: dict[str, Any] | None = None  # the JSON body of a non-200 answer

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [data for event, data in self.events if event == "token"]

    @property
    def text(self) -> str:
        return "".join(t["token"] for t in self.tokens)

    @property
    def last(self) -> tuple[str, dict[str, Any]]:
        return self.events[-1]

    @property
    def refusal(self) -> dict[str, Any] | None:
        """A worker's refusal after its head: an `error` event in place of `admitted`, alone (nothing
        ran; protocol.worker.AdmittedEvent). None for any other stream."""
        if self.status == 200 and [event for event, _ in self.events] == ["error"]:
            return self.events[0][1]
        return None




def generate(url: str, payload: dict[str, Any], *, path: str = "/worker/generate", timeout: float = 60,
             headers: dict[str, str] | None = None) -> Stream:
    with httpx.Client(timeout=timeout) as client, client.stream("POST", url + path, json=payload,
                                                                 headers=headers or {}) as response:
        if response.status_code != 200:
            response.read()
            return Stream(response.status_code, dict(response.headers), body=response.json())
        parser = SseParser()
        raw = [event for chunk in response.iter_bytes() for event in parser.feed(chunk)]
        if (last := parser.close()) is not None:
            raw.append(last)
    events = [(e.event, json.loads(e.data)) for e in raw]
    for event, data in events:
        if event == "error":
            check_error_event(data)
    return Stream(200, dict(response.headers), events)
