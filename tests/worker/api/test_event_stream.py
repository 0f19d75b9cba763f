"""The worker's SSE response on its own, over a fake ASGI server: order and ending, pings while idle,
a client that disconnects, a write that stays blocked, and the token event's JSON."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, MutableMapping
from typing import Any

import pytest

from protocol.sse import SseParser, encode
from protocol.worker import TokenEvent
from worker.api.event_stream import PING, EventStream, token_event

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the worker runs on uvicorn's asyncio loop


class Server:
    """Collects what the response sends; `block` makes body writes hang; `gone` says the client left."""

    def __init__(self) -> None:
        self.messages: list[MutableMapping[str, Any]] = []
        self.block = asyncio.Event()
        self.block.set()
        self.gone = asyncio.Event()

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            await self.block.wait()
        self.messages.append(message)

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def stream(events: AsyncGenerator[bytes, None], *, ping: float = 0.05, timeout: float = 0.2) -> EventStream:
    return EventStream(events, headers={"x-worker-id": "w1"}, ping_interval=ping, send_timeout=timeout)


async def test_events_in_order_then_the_end_with_pings_while_idle() -> None:
    async def events() -> AsyncGenerator[bytes, None]:
        yield token_event("Hi", 0, 0.5)
        await asyncio.sleep(0.2)  # a long prefill: pings meanwhile
        yield encode("done", '{"finished":true}')

    server = Server()
    await stream(events())({"type": "http"}, server.receive, server.send)
    start = server.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and headers[b"x-worker-id"] == b"w1"
    assert server.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    body = server.body()
    assert body.count(PING) >= 2
    parsed = SseParser().feed(body)
    assert [e.event for e in parsed] == ["token", "done"]
    assert json.loads(parsed[0].data) == {"token": "Hi", "index": 0, "probability": 0.5, "finished": False}


async def test_a_client_that_disconnects_closes_the_events_at_once() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            yield token_event("a", 0, 1.0)
            await asyncio.sleep(30)
            yield token_event("never", 1, 1.0)
        finally:
            closed.set()

    server = Server()
    task = asyncio.create_task(stream(events())({"type": "http"}, server.receive, server.send))
    await asyncio.sleep(0.05)
    server.gone.set()
    await asyncio.wait_for(task, 2)
    assert closed.is_set() and b"never" not in server.body()


async def test_a_write_blocked_past_the_send_timeout_ends_the_stream() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            while True:
                yield token_event("x", 0, 1.0)
        finally:
            closed.set()

    server = Server()
    server.block.clear()  # the client stopped reading
    task = asyncio.create_task(stream(events(), ping=0.05, timeout=0.2)({"type": "http"}, server.receive,
                                                                         server.send))
    await asyncio.sleep(0.1)
    assert not task.done()  # within its deadline it waits
    await asyncio.wait_for(task, 2)
    assert closed.is_set()


async def test_an_error_in_the_events_reaches_the_server() -> None:
    async def events() -> AsyncGenerator[bytes, None]:
        yield token_event("a", 0, 1.0)
        raise RuntimeError("boom")

    server = Server()
    with pytest.raises(RuntimeError, match="boom"):
        await stream(events())({"type": "http"}, server.receive, server.send)


@pytest.mark.parametrize(("text", "probability", "choice"),
                         [("Hi", 0.41, 0), ("é \" \\ \n", 1.0, 0), ("", 1e-07, 0), ("x", None, 0), ("y", 0.5, 3)])
def test_the_token_event_json_is_the_protocols(text: str, probability: float | None, choice: int) -> None:
    raw = token_event(text, 3, probability, choice)
    (parsed,) = SseParser().feed(raw)
    assert parsed.event == "token"
    event = TokenEvent(token=text, index=3, probability=probability, choice=choice)
    assert TokenEvent.model_validate_json(parsed.data) == event
    assert ('"choice"' in parsed.data) == (choice != 0)  # left out for choice 0, as before `n` existed


def test_a_probability_outside_0_1_is_refused_not_sent() -> None:
    with pytest.raises(ValueError):
        token_event("x", 0, float("nan"))
