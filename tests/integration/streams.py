"""An async SSE reader for integration tests that keeps the arrival time of every event."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Timed:
    status: int
    headers: dict[str, str]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() at each event's arrival
    body: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    @property
    def token_times(self) -> list[float]:
        return [t for (name, _), t in zip(self.events, self.times, strict=True) if name == "token"]


async def read_events(response: httpx.Response, into: Timed, *, stop_after_tokens: int | None = None) -> None:
    name, data = "message", list[str]()
    async for line in response.aiter_lines():
        if line == "":
            if data:
                into.events.append((name, json.loads("\n".join(data))))
                into.times.append(time.monotonic())
                if stop_after_tokens is not None and into.names.count("token") >= stop_after_tokens:
                    return
            name, data = "message", list[str]()
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


async def infer(client: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                stop_after_tokens: int | None = None, headers: dict[str, str] | None = None) -> Timed:
    """POST and read the stream (or the error body); stop early (closing the connection) if asked."""
    async with client.stream("POST", url + "/coordinator/infer", json=body, headers=headers or {}) as response:
        timed = Timed(response.status_code, dict(response.headers))
        if response.status_code != 200:
            await response.aread()
            timed.body = response.json()
            return timed
        await read_events(response, timed, stop_after_tokens=stop_after_tokens)
    return timed
