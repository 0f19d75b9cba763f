"""A stand-in coordinator on 127.0.0.1 for the batch client's refusal tests: it answers 503 with
`Retry-After` a set number of times (or always), then streams a canned, valid `/coordinator/infer`
answer built from the protocol's own event types. It records when each request arrived and its headers.

Runs aiohttp in a thread of its own, so the client under test can be a real subprocess.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from protocol import reasons
from protocol.inference import EVENT_DONE, EVENT_TOKEN, DoneEvent, ErrorBody, Timings, TokenEvent, Usage
from protocol.sse import encode

TOKENS = ("Paris", " is", " the", " capital")


@dataclass
class Arrival:
    at: float  # time.monotonic()
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeCoordinator:
    refusals: int | None = 0  # requests refused before the first served; None: refuse every one
    retry_after: str | None = "1"
    status: int = 503
    arrivals: list[Arrival] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> FakeCoordinator:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _serve(self) -> int:
        app = web.Application()
        app.router.add_post("/coordinator/infer", self._infer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        n = len(self.arrivals)
        self.arrivals.append(Arrival(time.monotonic(), dict(request.headers), await request.json()))
        request_id = f"fake-{n}"
        if self.refusals is None or n < self.refusals:
            headers = {"retry-after": self.retry_after} if self.retry_after is not None else {}
            body = ErrorBody(error="the admission queue is full", reason=reasons.QUEUE_FULL, request_id=request_id)
            return web.json_response(body.model_dump(), status=self.status, headers=headers)
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-worker-id": "fake-w1",
                                               "x-request-id": request_id})
        await response.prepare(request)
        for i, token in enumerate(TOKENS):
            await response.write(encode(EVENT_TOKEN, TokenEvent(token=token, index=i, probability=0.5)
                                        .model_dump_json()))
        done = DoneEvent(finish_reason="length",
                         usage=Usage(prompt_tokens=7, cached_tokens=0, completion_tokens=len(TOKENS),
                                     total_tokens=7 + len(TOKENS)),
                         timings=Timings(queue_ms=0.1, prefill_ms=1.0, ttft_ms=1.5, total_ms=3.0, tokens_per_second=1000),
                         request_id=request_id, worker_id="fake-w1", model="fake-model")
        await response.write(encode(EVENT_DONE, done.model_dump_json()))
        await response.write_eof()
        return response
