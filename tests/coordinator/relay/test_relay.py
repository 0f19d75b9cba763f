"""Relay and its client-side response, driven with a fake worker stream and a fake ASGI client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from coordinator.clock import SystemClock
from coordinator.metrics import CoordinatorMetrics
from coordinator.relay.dispatch import worker_events
from coordinator.relay.response import RelayResponse
from coordinator.relay.stream import Relay
from coordinator.relay.supervisor import Ending
from coordinator.upstream import WorkerStreamError
from protocol.sse import SseEvent, SseParser
from tests.coordinator.fakes import done, token
from tests.sse import check_error_event

pytestmark = pytest.mark.anyio


@dataclass
class FakeStream:
    """Stands in for dispatch.OpenStream: a first event, the rest, and whether it was closed."""

    chunks: list[bytes]
    delay: float = 0.0
    fail: bool = False
    closed: bool = False
    first: SseEvent = field(init=False)
    events: AsyncIterator[SseEvent] = field(init=False)

    def __post_init__(self) -> None:
        parsed = [e for c in self.chunks for e in SseParser().feed(c)]
        self.first, rest = parsed[0], parsed[1:]
        self.events = self._gen(rest)

    async def _gen(self, rest: list[SseEvent]) -> AsyncIterator[SseEvent]:
        for event in rest:
            if self.delay:
                await asyncio.sleep(self.delay)
            yield event
        if self.fail:
            raise WorkerStreamError("reset")

    async def close(self) -> None:
        self.closed = True


@dataclass
class FakeClient:
    """An ASGI peer: records bodies; stops reading (send blocks) after `reads` messages."""

    reads: int = 1_000_000
    leave_after: float | None = None
    bodies: list[bytes] = field(default_factory=list)
    complete: bool = False

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if len(self.bodies) >= self.reads:
            await asyncio.Event().wait()  # a full socket: never drains
        if message["type"] == "http.response.body":
            self.bodies.append(message["body"])
            self.complete = not message.get("more_body", False)

    async def receive(self) -> MutableMapping[str, Any]:
        if self.leave_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.leave_after or 0.0)
        return {"type": "http.disconnect"}


async def run(stream: FakeStream, client: FakeClient, *, buffer: int = 4, deadline: float = 0.2,
              ping: float = 10.0) -> tuple[Ending, Relay]:
    relay = Relay(stream, request_id="r1", buffer_events=buffer, write_deadline=deadline,  # type: ignore[arg-type]
                  metrics=CoordinatorMetrics())
    endings: list[Ending] = []
    response = RelayResponse(relay, headers={}, ping_interval=ping, clock=SystemClock(), on_end=endings.append)
    await asyncio.wait_for(response({"type": "http"}, client.receive, client.send), timeout=5)
    assert len(endings) == 1
    return endings[0], relay


def tokens(n: int) -> list[bytes]:
    return [token(i, f"t{i}") for i in range(n)] + [done(n=n)]


async def test_complete_stream_is_relayed_in_order_and_finished() -> None:
    stream, client = FakeStream(tokens(20)), FakeClient()
    ending, relay = await run(stream, client)
    assert ending is Ending.COMPLETE and client.complete and stream.closed
    text = b"".join(client.bodies).decode()
    assert [f'"t{i}"' in text for i in range(20)] == [True] * 20
    assert text.index('"t3"') < text.index('"t4"') and text.rstrip().endswith("}")
    assert relay.outcome.tokens == 20 and relay.outcome.done is not None
    assert relay.outcome.first_token_at is not None


@dataclass
class SlowSocket(FakeClient):
    """A client whose every send takes `pause` seconds, as a busy socket or a busy core makes it."""

    pause: float = 0.02

    async def send(self, message: MutableMapping[str, Any]) -> None:
        await asyncio.sleep(self.pause)
        await super().send(message)


async def test_events_waiting_in_the_buffer_go_out_in_one_send_in_order() -> None:
    stream, client = FakeStream(tokens(40), delay=0.001), SlowSocket()
    ending, relay = await run(stream, client, buffer=64)
    assert ending is Ending.COMPLETE and client.complete and relay.outcome.tokens == 40
    text = b"".join(client.bodies).decode()
    events = [e for e in text.split("\r\n\r\n") if e.strip()]
    assert [f'"t{i}"' in events[i] for i in range(40)] == [True] * 40 and events[40].startswith("event: done")
    # Events were coalesced while a send was under way, so far fewer sends than events.
    sent = [b for b in client.bodies if b]
    assert len(sent) < 20 and max(body.count(b"event: token") for body in sent) > 1


async def test_a_writer_that_keeps_up_sends_each_event_as_it_comes() -> None:
    stream, client = FakeStream(tokens(5), delay=0.02), FakeClient()
    await run(stream, client)
    assert [b.count(b"event: ") for b in client.bodies if b] == [1] * 6


async def test_slow_client_is_cut_at_the_deadline_without_losing_order() -> None:
    stream, client = FakeStream(tokens(200)), FakeClient(reads=10)
    started = time.monotonic()
    ending, _relay = await run(stream, client, buffer=4, deadline=0.2)
    elapsed = time.monotonic() - started
    assert ending is Ending.SLOW_CLIENT and not client.complete
    assert stream.closed  # the worker request is closed, so the worker frees its KV
    assert 0.2 <= elapsed < 1.0
    # What the client did get is an unbroken prefix: nothing was dropped before the cut.
    text = b"".join(client.bodies).decode()
    got = [i for i in range(200) if f'"t{i}"' in text]
    assert got == list(range(len(got)))


async def test_client_that_leaves_cancels_the_worker_request() -> None:
    stream, client = FakeStream(tokens(100), delay=0.01), FakeClient(leave_after=0.05)
    ending, relay = await run(stream, client)
    assert ending is Ending.CLIENT_GONE and stream.closed
    assert relay.outcome.tokens < 100


async def test_broken_worker_stream_ends_with_an_error_event(caplog: pytest.LogCaptureFixture) -> None:
    """The client gets the reason and a short message; the exception's text goes to the log only
    (before: `the worker's stream broke: ClientPayloadError ... TransferEncodingError` reached clients)."""
    stream, client = FakeStream(tokens(3)[:3], fail=True), FakeClient()
    ending, relay = await run(stream, client)
    assert ending is Ending.COMPLETE and client.complete
    last = last_event(client)
    assert last.startswith("event: error") and '"worker_failed"' in last and '"r1"' in last
    check_error_event(json.loads(last.split("data: ", 1)[1]))
    assert relay.outcome.error_reason == "worker_failed"
    assert "reset" in caplog.text and "r1" in caplog.text  # the WorkerStreamError's text, logged


async def test_idle_stream_gets_pings() -> None:
    stream, client = FakeStream(tokens(2), delay=0.12), FakeClient()
    ending, _ = await run(stream, client, ping=0.05)
    assert ending is Ending.COMPLETE
    assert b": ping\r\n\r\n" in client.bodies


async def test_worker_events_reassembles_split_reads() -> None:
    whole = b"".join(tokens(5))

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(whole), 7):
            yield whole[i:i + 7]

    events = [e async for e in worker_events(body())]
    assert [e.event for e in events] == ["token"] * 5 + ["done"]


async def test_worker_events_turns_an_oversized_event_into_a_stream_error() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield token(0)
        yield b"data: " + b"x" * (2 << 20)  # no end of event in sight, past the parser's limit

    with pytest.raises(WorkerStreamError):
        [e async for e in worker_events(body())]


async def test_the_final_event_frees_the_reservation_before_the_client_can_read_it() -> None:
    """No bounce at the seam: a closed-loop client's next request, sent the moment it reads `done`,
    must find the slot free; so `on_final` runs before `done` is even queued for the writer."""
    seen_in_queue: list[int] = []

    def on_final(outcome: object) -> None:
        seen_in_queue.append(relay.queue.qsize())

    relay = Relay(FakeStream([token(0), token(1), done()]), request_id="r", buffer_events=8,  # type: ignore[arg-type]
                  write_deadline=1.0, metrics=CoordinatorMetrics(), on_final=on_final)
    await relay.run()
    assert seen_in_queue == [2]  # both tokens queued, `done` not yet; and only once
    assert relay.outcome.done is not None


async def test_a_broken_or_abandoned_stream_also_frees_it_once() -> None:
    calls: list[object] = []
    broken = Relay(FakeStream([token(0), token(1)], fail=True), request_id="r", buffer_events=8,  # type: ignore[arg-type]
                   write_deadline=1.0, metrics=CoordinatorMetrics(), on_final=calls.append)
    await broken.run()
    assert len(calls) == 1 and broken.outcome.error_reason == "worker_failed"
    abandoned = Relay(FakeStream([token(0), token(1), done()], delay=10), request_id="r", buffer_events=8,  # type: ignore[arg-type]
                      write_deadline=1.0, metrics=CoordinatorMetrics(), on_final=calls.append)
    reader = asyncio.create_task(abandoned.run())
    await asyncio.sleep(0.01)
    reader.cancel()  # the client left: the reader is cancelled
    await asyncio.gather(reader, return_exceptions=True)
    assert len(calls) == 2


async def test_an_aborted_stream_ends_with_an_error_event_and_closes_the_worker_request() -> None:
    """The drain's deadline: a stream still running is ended with `error`, never just cut."""
    stream, client = FakeStream(tokens(100), delay=0.01), FakeClient()
    relay = Relay(stream, request_id="r1", buffer_events=4, write_deadline=1.0,  # type: ignore[arg-type]
                  metrics=CoordinatorMetrics())
    endings: list[Ending] = []
    response = RelayResponse(relay, headers={}, ping_interval=10, clock=SystemClock(), on_end=endings.append)
    serving = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
    await asyncio.sleep(0.05)
    relay.abort("draining", "shutting down")
    await asyncio.wait_for(serving, timeout=5)
    assert endings == [Ending.COMPLETE] and client.complete and stream.closed
    last = last_event(client)
    assert last.startswith("event: error") and '"draining"' in last
    assert relay.outcome.error_reason == "draining" and relay.outcome.tokens < 100


async def test_abort_after_the_final_event_changes_nothing() -> None:
    stream, client = FakeStream(tokens(3)), FakeClient()
    ending, relay = await run(stream, client)
    relay.abort("draining", "late")
    assert ending is Ending.COMPLETE and relay.outcome.done is not None and relay.outcome.error_reason is None


def last_event(client: FakeClient) -> str:
    """The last event the client got (events waiting together go out in one body)."""
    return [e for e in b"".join(client.bodies).decode().split("\r\n\r\n") if e.strip()][-1]


class Exploding(FakeStream):
    async def _gen(self, rest: list[SseEvent]) -> AsyncIterator[SseEvent]:
        yield rest[0]
        raise RuntimeError("a bug in the reader")


async def test_a_fault_in_the_reader_ends_the_stream_with_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the client got pings forever, and nothing was logged."""
    stream, client = Exploding(tokens(5)), FakeClient()
    metrics = CoordinatorMetrics()
    relay = Relay(stream, request_id="r9", buffer_events=4, write_deadline=1.0,  # type: ignore[arg-type]
                  metrics=metrics)
    endings: list[Ending] = []
    response = RelayResponse(relay, headers={}, ping_interval=0.05, clock=SystemClock(), on_end=endings.append)
    await asyncio.wait_for(response({"type": "http"}, client.receive, client.send), timeout=5)
    assert endings == [Ending.COMPLETE] and client.complete and stream.closed
    last = last_event(client)
    assert last.startswith("event: error") and '"internal"' in last and '"r9"' in last
    assert "a bug in the reader" in caplog.text and "r9" in caplog.text
    assert metrics.internal_errors.labels(task="relay_reader")._value.get() == 1


async def test_a_fault_in_the_writer_is_logged_as_internal_not_client_gone(caplog: pytest.LogCaptureFixture) -> None:
    stream = FakeStream(tokens(5))
    relay = Relay(stream, request_id="r8", buffer_events=4, write_deadline=1.0,  # type: ignore[arg-type]
                  metrics=CoordinatorMetrics())
    endings: list[Ending] = []

    def broken(event: SseEvent) -> bytes:
        raise ValueError("a bug in the encoder")

    response = RelayResponse(relay, headers={}, ping_interval=10, clock=SystemClock(), on_end=endings.append,
                             encoder=broken)
    await asyncio.wait_for(response({"type": "http"}, FakeClient().receive, FakeClient().send), timeout=5)
    assert endings == [Ending.INTERNAL] and stream.closed
    assert "a bug in the encoder" in caplog.text and "r8" in caplog.text
