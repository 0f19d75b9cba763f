"""The worker client over real loopback sockets: streaming, connection reuse, cancel by closing, errors; and the
worker token it carries on every path that calls a worker."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.pool.registry import WorkerRecord
from coordinator.settings import Settings
from coordinator.state import CoordinatorState, build_state
from coordinator.upstream import (
    AiohttpWorkerClient,
    WorkerRefused,
    WorkerStreamError,
    WorkerUnreachable,
)
from protocol.health import OfferedModel
from protocol.tokens import TokenizeResponse
from protocol.worker import (
    EMBED_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    MODEL_LOAD_PATH,
    SESSIONS_PATH,
    TOKENIZE_PATH,
    EmbedRequest,
    GenerateRequest,
    TokenizeWork,
)
from tests.conftest import free_port
from tests.coordinator.fakes import FakeWorkerClient, embedding_service, heartbeat

pytestmark = pytest.mark.anyio

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-worker-id: w7\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class Server:
    """A raw HTTP/1.1 server: answers each request on a connection with `parts` (then, unless
    `break_after`, the last chunk), and records connections, bodies and disconnects."""

    parts: list[bytes]
    break_after: bool = False
    connections: int = 0
    bodies: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.bodies.append(await reader.readexactly(length))
                writer.write(HEAD)
                for part in self.parts:
                    writer.write(chunk(part))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if self.break_after:
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnected.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(server: Server) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/worker/generate"
    finally:
        listener.close()


@pytest.fixture
async def upstream() -> AsyncIterator[AiohttpWorkerClient]:
    client = AiohttpWorkerClient(max_connections=10, connect_timeout=2, read_timeout=2, keepalive_expiry=5)
    yield client
    await client.close()


async def test_streams_the_body_and_reuses_the_connection_once_it_was_read_to_the_end(
        upstream: AiohttpWorkerClient) -> None:
    server = Server([b"one", b"two"])
    async with serving(server) as url:
        for _ in range(2):
            response = await upstream.post(url, b'{"prompt":"x"}', {"content-type": "application/json"})
            assert response.status == 200 and response.header("x-worker-id") == "w7"
            assert [c async for c in response.chunks()] == [b"one", b"two"]
            await response.close()
        assert server.bodies == [b'{"prompt":"x"}'] * 2
        assert server.connections == 1


async def test_closing_before_the_end_closes_the_connection(upstream: AiohttpWorkerClient) -> None:
    server = Server([b"x"] * 50)
    async with serving(server) as url:
        response = await upstream.post(url, b"{}", {})
        assert await anext(response.chunks()) == b"x"
        await response.close()
        await asyncio.wait_for(server.disconnected.wait(), 2)  # how the worker learns of the cancel


async def test_a_broken_body_is_a_stream_error(upstream: AiohttpWorkerClient) -> None:
    server = Server([b"x"], break_after=True)
    async with serving(server) as url:
        response = await upstream.post(url, b"{}", {})
        with pytest.raises(WorkerStreamError):
            [c async for c in response.chunks()]
        await response.close()


async def test_nobody_listening_is_a_refused_connection(upstream: AiohttpWorkerClient) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WorkerRefused):
        await upstream.post(url + "/worker/generate", b"{}", {})
    with pytest.raises(WorkerRefused):
        await upstream.get(url + "/worker/health")
    with pytest.raises(WorkerRefused):
        await upstream.exchange("GET", url + "/worker/sessions", {}, limit=100, timeout=1)


async def test_a_timeout_is_unreachable_but_not_refused() -> None:
    """A worker that is slow to accept may still be there: only a refusal marks it gone."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: the answer never comes
    client = AiohttpWorkerClient(max_connections=4, connect_timeout=0.2, read_timeout=0.2, keepalive_expiry=1)
    try:
        with pytest.raises(WorkerUnreachable) as caught:
            await client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/worker/health")
        assert not isinstance(caught.value, WorkerRefused)
    finally:
        await client.close()
        listener.close()


# --- the worker token: carried by the client (upstream.with_token), on every path that calls a worker ---

TOKEN = "s3cret"
GEMMA = OfferedModel(name="gemma", state="offered", need_bytes=10)


def drained(state: CoordinatorState, worker: WorkerRecord) -> Awaitable[object]:
    """A drain's session moves: the mover lists the worker's kept sessions first (its own task)."""
    state.mover.draining(worker)
    return asyncio.sleep(0)


# Each path that calls a worker: how it is made to call, and the route it calls.
CALLERS: dict[str, tuple[Callable[[CoordinatorState, WorkerRecord], Awaitable[object]], str]] = {
    "generation": (lambda state, worker: state.attempts.open(
        Generation.of(GenerateRequest(prompt="hi", max_tokens=2), "r1", "test"), [worker]), GENERATE_PATH),
    "embeddings": (lambda state, worker: state.embedder.embed(
        Embedding.of(EmbedRequest(inputs=["hi"]), "r1", "test"), [worker]), EMBED_PATH),
    "tokenizer": (lambda state, worker: state.tokenizing.ask(
        TOKENIZE_PATH, None, TokenizeWork(prompt="hi", add_special=True), TokenizeResponse, "r1"), TOKENIZE_PATH),
    "model load": (lambda state, worker: state.loads.wanted("gemma"), MODEL_LOAD_PATH),
    "session end": (lambda state, worker: state.mover.end(worker, "s1", "t"), SESSIONS_PATH + "/s1"),
    "session moves": (drained, SESSIONS_PATH),
    "probe": (lambda state, worker: state.probe.prove(worker.worker_id, worker.url), HEALTH_PATH),
}
# The probe's URL is not proven to be a worker's yet (pool/probe.py): it gets no secret.
UNTOKENED = {"probe"}


@pytest.mark.parametrize("token", [TOKEN, None])
@pytest.mark.parametrize("caller", list(CALLERS))
async def test_every_call_to_a_worker_carries_the_worker_token_but_the_probe(caller: str, token: str | None) -> None:
    seen: dict[str, str | None] = {}  # route -> the authorization header it got

    def worker(request: httpx.Request) -> httpx.Response:  # every route refuses: only what was sent matters
        seen[request.url.path] = request.headers.get("authorization")
        return httpx.Response(503, json={"error": "busy", "reason": "loading", "request_id": "x"})

    clock = ManualClock()
    state = build_state(Settings(worker_token=token), clock,
                        FakeWorkerClient(httpx.AsyncClient(transport=httpx.MockTransport(worker))))
    record = state.registry.upsert(heartbeat("w1", timestamp=clock.time(), embeddings=embedding_service())
                                   .model_copy(update={"offered": [GEMMA]}), clock.monotonic())
    call, route = CALLERS[caller]
    try:
        with contextlib.suppress(CoordinatorError):
            await call(state, record)
        for _ in range(100):  # a drain's moves run in a task of their own
            if route in seen:
                break
            await asyncio.sleep(0.01)
    finally:
        await state.mover.close()
        await state.client.close()
    sent = f"Bearer {token}" if token and caller not in UNTOKENED else None
    assert route in seen and seen[route] == sent
