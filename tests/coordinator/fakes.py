"""Fakes for the coordinator's unit tests: heartbeats, fake workers (behaviours behind an httpx.MockTransport),
and an app running in-process with its lifespan entered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.upstream import WorkerRefused, WorkerStreamError, WorkerUnreachable
from protocol.health import EmbeddingService, Heartbeat, WorkerLoad
from protocol.worker import RESPONSES_HANDOVER_PATH, RESPONSES_PATH

MODEL = "smol"


def load(**over: Any) -> WorkerLoad:
    values: dict[str, Any] = {"sessions": 0, "max_sessions": 4, "active_streams": 0, "queue_depth": 0, "kv_used_bytes": 0,
                                  "kv_reserved_bytes": 0, "kv_capacity_bytes": 1_000_000, "bytes_per_token": 100,
                                  "session_max_tokens": 2_000}
    values.update(over)
    return WorkerLoad(**values)


def heartbeat(worker_id: str, *, timestamp: float, model: str = MODEL, url: str | None = None,
              aliases: tuple[str, ...] = (), model_identity: str = "", embeddings: EmbeddingService | None = None,
              **load_over: Any) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, url=url or f"http://{worker_id}.test", model=model,
                     aliases=list(aliases), model_identity=model_identity, embeddings=embeddings,
                     load=load(**load_over), timestamp=timestamp)


def embedding_service(dimensions: int = 4, capacity: int = 4, max_tokens: int = 512) -> EmbeddingService:
    return EmbeddingService(dimensions=dimensions, max_tokens=max_tokens, pooling="mean", capacity=capacity)


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\r\ndata: {json.dumps(data)}\r\n\r\n".encode()


def admitted(prompt_tokens: int = 5) -> bytes:
    """A worker stream's first event (protocol.worker.AdmittedEvent)."""
    return sse("admitted", {"prompt_tokens": prompt_tokens})


def token(i: int, text: str = "x") -> bytes:
    return sse("token", {"token": text, "index": i, "probability": 0.5, "finished": False})


def done(request_id: str = "r", worker_id: str = "w1", n: int = 3, reason: str = "stop") -> bytes:
    return sse("done", {
        "finished": True, "finish_reason": reason,
        "usage": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": n, "total_tokens": 5 + n},
        "timings": {"queue_ms": 0, "prefill_ms": 1, "ttft_ms": 1, "total_ms": 2, "tokens_per_second": 10},
        "request_id": request_id, "worker_id": worker_id, "model": MODEL})


Behaviour = Callable[[httpx.Request], httpx.Response]


class _FakeResponse:
    """`coordinator.upstream.WorkerResponse` over an httpx response from a MockTransport."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise WorkerStreamError(str(exc)) from exc

    async def read(self) -> bytes:
        return await self._response.aread()

    async def close(self) -> None:
        await self._response.aclose()


class Gone(httpx.ConnectError):
    """The connection was refused: nothing listens there (a `gone` host)."""


def _unreachable(exc: httpx.HTTPError) -> WorkerUnreachable:
    return (WorkerRefused if isinstance(exc, Gone) else WorkerUnreachable)(str(exc))


class FakeWorkerClient:
    """`coordinator.upstream.WorkerClient` whose network is fake workers' behaviours."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   read_timeout: float | None = None) -> _FakeResponse:
        request = self._client.build_request("POST", url, content=body, headers=dict(headers))
        try:
            return _FakeResponse(await self._client.send(request, stream=True))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    async def get(self, url: str) -> tuple[int, bytes]:
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        return response.status_code, response.content

    async def delete(self, url: str, headers: Mapping[str, str]) -> int:
        try:
            return (await self._client.delete(url, headers=dict(headers))).status_code
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        try:
            response = await self._client.request(method, url, content=body, headers=dict(headers))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        if len(response.content) > limit:
            raise WorkerUnreachable(f"the answer is over {limit} bytes")
        return response.status_code, response.content

    async def close(self) -> None:
        await self._client.aclose()


@dataclass
class FakeWorkers:
    """Workers by host name; each answers /worker/generate with its behaviour, and the coordinator's
    probe of a new worker (`GET /worker/health`) as the worker its host names (`ids` may name another
    one), unless the host is `silent` (it never answers anything) or `gone` (its connections are refused:
    `WorkerRefused`, as for a port nothing listens on)."""

    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    calls: list[tuple[str, httpx.Request]] = field(default_factory=list)  # all but the probes
    probes: list[str] = field(default_factory=list)
    silent: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    ids: dict[str, str] = field(default_factory=dict)
    # Stored Responses records, as each worker keeps them (worker/api/records.py): (host, tenant, id) -> body.
    records: dict[tuple[str, str, str], bytes] = field(default_factory=dict)

    def client(self) -> FakeWorkerClient:
        async def handle(request: httpx.Request) -> httpx.Response:
            host = request.url.host.removesuffix(".test")
            if host in self.silent:
                raise httpx.ConnectError("connection refused", request=request)
            if host in self.gone:
                raise Gone("connection refused: nothing listens", request=request)
            if request.method == "GET" and request.url.path == "/worker/health":
                self.probes.append(host)
                return httpx.Response(200, json={"status": "ok", "worker_id": self.ids.get(host, host),
                                                 "model": MODEL})
            if request.url.path.startswith(RESPONSES_PATH + "/"):
                return self._record(host, request)
            self.calls.append((host, request))
            behaviour = self.behaviours.get(host)
            if behaviour is None:
                raise httpx.ConnectError("connection refused", request=request)
            return behaviour(request)

        return FakeWorkerClient(httpx.AsyncClient(transport=httpx.MockTransport(handle)))

    def _record(self, host: str, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == RESPONSES_HANDOVER_PATH:  # all at once
            taken = [k for k in self.records if k[0] == host]
            listed = [{"tenant": t, "response_id": r, "record": json.loads(self.records.pop((h, t, r)))}
                      for h, t, r in taken]
            return httpx.Response(200, json={"records": listed})
        key = (host, request.url.params.get("tenant", ""), request.url.path.rsplit("/", 1)[1])
        if request.method == "PUT":
            self.records[key] = request.content
            return httpx.Response(204)
        if key not in self.records:
            return httpx.Response(404, json={"error": "no such record", "reason": "unknown_response",
                                             "request_id": "x"})
        if request.method == "DELETE":
            del self.records[key]
            return httpx.Response(204)
        return httpx.Response(200, content=self.records[key], headers={"content-type": "application/json"})

    def hosts_called(self) -> list[str]:
        return [host for host, _ in self.calls]


def streaming(chunks: list[bytes], *, prompt_tokens: int = 5, worker_id: str = "w1",
              fail_after: bool = False) -> Behaviour:
    """A worker that answers 200 and streams `admitted`, then `chunks` (optionally breaking the
    connection after)."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for chunk in [admitted(prompt_tokens), *chunks]:
                yield chunk
            if fail_after:
                raise httpx.ReadError("connection reset", request=request)

        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-worker-id": worker_id,
                                            "x-request-id": request.headers.get("x-request-id", "")},
                              content=body())

    return behaviour


def refusing(status: int, reason: str, retry_after: int | None = None) -> Behaviour:
    def behaviour(request: httpx.Request) -> httpx.Response:
        headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
        return httpx.Response(status, headers=headers, json={"error": reason, "reason": reason,
                                                             "request_id": "x"})

    return behaviour


def refusing_in_stream(reason: str) -> Behaviour:
    """A worker that answers its head, then finds while preparing that it must refuse: an `error`
    event in place of `admitted`."""
    def behaviour(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse("error", {"error": f"refused: {reason}", "reason": reason, "request_id": "x",
                                "finished": True})

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return behaviour


def pinging(*, admitted_first: bool, interval: float = 0.02) -> Behaviour:
    """A worker that answers its head and pings, alive, but sends no token: still preparing the prompt
    (`admitted_first` False) or admitted and never starting (True)."""
    def behaviour(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            if admitted_first:
                yield admitted()
            while True:
                await asyncio.sleep(interval)
                yield b": ping\r\n\r\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return behaviour


@asynccontextmanager
async def running_app(settings: Settings, fakes: FakeWorkers, clock: ManualClock
                      ) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, clock=clock, worker_client=fakes.client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                   base_url="http://coord") as client:
        yield client


async def register(client: httpx.AsyncClient, hb: Heartbeat, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return await client.post("/coordinator/health/heartbeat", content=hb.model_dump_json(), headers=headers)


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        out.append((name, json.loads(data)))
    return out
