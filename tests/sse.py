"""A small SSE client for tests: posts a request and collects (event, data) pairs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from protocol.sse import SseParser


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
    return Stream(200, dict(response.headers), [(e.event, json.loads(e.data)) for e in raw])
