"""Every stage of a request's life, with an exception injected there: the client still gets an ending
(an HTTP error before the first byte, an `error` event after it) within a second, the reservation
and the worker's request are given back, the fault is logged once and counted once.

Before the supervisor, a failure in the final callback (a response cache on a full disk) left the
client with pings forever, and a collector's fault was counted as the client leaving."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator import cache as cache_module
from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.state import CoordinatorState
from tests.coordinator.fakes import (
    FakeWorkers,
    admitted,
    done,
    events_of,
    heartbeat,
    register,
    running_app,
    token,
)

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0)
CHUNKS = [token(0, "He"), token(1, "llo"), token(2, "!"), done()]


class Injected(Exception):
    """The fault a case injects; its text shows in the one log line."""


def boom(*_: object, **__: object) -> Any:
    raise Injected("injected fault")


class Exploding:
    """Stands in for a metric or any object: `method` raises on its `after`-th call (0: the first)."""

    def __init__(self, method: str, after: int = 0) -> None:
        self._method, self._after, self.calls = method, after, 0

    def __getattr__(self, name: str) -> Callable[..., None]:
        def call(*_: object, **__: object) -> None:
            if name == self._method:
                self.calls += 1
                if self.calls > self._after:
                    raise Injected("injected fault")
        return call


class ExplodingSet(set):  # type: ignore[type-arg]
    def add(self, item: object) -> None:
        raise Injected("injected fault")


@dataclass
class Worker:
    """A fake worker that streams `chunks` and counts the responses the coordinator closed (closing
    is what cancels the request on a real worker and frees its sequence)."""

    chunks: tuple[bytes, ...] = tuple(CHUNKS)
    closed: int = 0

    def behaviour(self, request: httpx.Request) -> httpx.Response:
        worker = self

        class Body(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                for chunk in [admitted(), *worker.chunks]:
                    yield chunk

            async def aclose(self) -> None:
                worker.closed += 1

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Body())


Inject = Callable[[CoordinatorState, pytest.MonkeyPatch], None]


def on_state(attribute: str, value: Callable[[], object]) -> Inject:
    def inject(state: CoordinatorState, monkeypatch: pytest.MonkeyPatch) -> None:
        owner_path, _, name = attribute.rpartition(".")
        owner: object = state
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, name, value())
    return inject


def on_module(target: str) -> Inject:
    def inject(state: CoordinatorState, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(target, boom)
    return inject


@dataclass(frozen=True)
class Case:
    stage: str
    inject: Inject
    task: str  # the internal_errors label it is counted under
    status: int  # the HTTP status the client gets
    ending: str | None  # the last SSE event (streamed), None for a JSON answer
    route: str = "/coordinator/infer"


CASES = [
    Case("admission", on_state("admission.check", lambda: boom), "open", 500, None),
    Case("dispatch", on_state("admission.confirm", lambda: boom), "open", 500, None),
    Case("first event", on_state("streams", ExplodingSet), "open", 500, None),
    Case("a token, reader", on_state("metrics.buffer_fill", lambda: Exploding("observe", after=1)),
         "relay_reader", 200, "error"),
    Case("a token, writer", on_module("coordinator.surfaces.infer.passthrough"), "relay_writer", 200, "error"),
    Case("after the last token", on_state("breakers.succeeded", lambda: boom), "on_final", 200, "error"),
    Case("after the response", on_state("metrics.e2e", lambda: Exploding("observe")), "on_end", 200, "done"),
    Case("the collector", on_module("coordinator.surfaces.openai.assemble"), "collector", 500, None,
         route="/v1/chat/completions"),
    Case("a streamed chat's encoder", on_module("coordinator.surfaces.openai_format.ChunkEncoder.__call__"),
         "relay_writer", 200, "error", route="/v1/chat/completions?stream"),
]


def body_of(route: str) -> tuple[str, dict[str, Any]]:
    if route.startswith("/v1/"):
        path, _, stream = route.partition("?")
        return path, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": bool(stream)}
    return route, {"prompt": "hi", "max_tokens": 3}


def last_event(text: str) -> str:
    """The last SSE event of a stream in either format (OpenAI's closing `[DONE]` left out)."""
    blocks = [b for b in text.replace("\r\n", "\n").split("\n\n") if b and not b.startswith(":")]
    if blocks[-1] == "data: [DONE]":
        blocks.pop()
    return blocks[-1]


@pytest.mark.parametrize("case", CASES, ids=[c.stage for c in CASES])
async def test_every_stage_ends_the_request_and_gives_everything_back(
        case: Case, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock, worker = ManualClock(), Worker()
    async with running_app(SETTINGS, FakeWorkers({"w1": worker.behaviour}), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        state: CoordinatorState = client._transport.app.state.coordinator  # type: ignore[attr-defined]
        case.inject(state, monkeypatch)
        path, body = body_of(case.route)
        began = time.monotonic()
        with caplog.at_level("INFO"):
            async with asyncio.timeout(5):  # a stream that never ends fails here instead of hanging
                response = await client.post(path, json=body)
        assert time.monotonic() - began < 1.0
        assert response.status_code == case.status
        if case.ending is None:
            answer = response.json()  # either surface's error shape
            assert answer.get("reason") == "internal" or answer["error"]["code"] == "internal"
        else:
            last = last_event(response.text)
            assert case.ending in last and (case.ending != "error" or "internal" in last)
        # Everything given back: no reservation, no stream, the worker's request closed (or never made).
        assert (state.admission.in_flight, state.admission.in_flight_kv_bytes, len(state.streams)) == (0, 0, 0)
        assert worker.closed == (1 if case.stage != "admission" else 0)
        faults = [r for r in caplog.records if '"internal_error"' in r.getMessage()]
        assert len(faults) == 1 and faults[0].exc_info is not None
        assert f'"task": "{case.task}"' in faults[0].getMessage() or f'"task":"{case.task}"' in faults[0].getMessage()
        assert state.metrics.internal_errors.labels(task=case.task)._value.get() == 1


async def test_a_cache_that_cannot_write_disables_itself_and_every_stream_ends_with_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    opened = cache_module.ResponseCache._open

    def full(path: Path) -> sqlite3.Connection:
        """A real connection whose database may grow no further: SQLite itself refuses every insert
        with `database or disk is full`, as on a full filesystem."""
        db = opened(path)
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
        return db

    monkeypatch.setattr(cache_module.ResponseCache, "_open", staticmethod(full))
    settings = Settings(heartbeat_interval=1.0, queue_size=0, cache_entries=1000,
                        cache_path=str(tmp_path / "cache.sqlite"))
    # Each answer is larger than a database page, so storing it needs a page SQLite may not add.
    clock, worker = ManualClock(), Worker(chunks=(token(0, "x" * 6000), done(n=1)))
    app = create_app(settings, clock=clock, worker_client=FakeWorkers({"w1": worker.behaviour}).client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                   base_url="http://c") as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert (await client.get("/coordinator/health")).json()["cache"] == "on"
        with caplog.at_level("INFO"):
            for prompt in ("one", "two", "one"):
                response = await client.post("/coordinator/infer",
                                             json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
                assert events_of(response.text)[-1][0] == "done"
        health = (await client.get("/coordinator/health")).json()
        state: CoordinatorState = app.state.coordinator
        assert health["cache"] == "disabled" and "full" in health["cache_failure"]
        assert state.metrics.cache_failures._value.get() == 1
        assert len([r for r in caplog.records if "cache_disabled" in r.getMessage()]) == 1
        assert worker.closed == 3  # nothing was answered from a cache that failed
        assert (state.admission.in_flight, len(state.streams)) == (0, 0)
