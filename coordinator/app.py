"""The coordinator's FastAPI app: `create_app(settings, clock=..., worker_client=...)`.

Owns: the lifespan that builds `app.state.coordinator` and `app.state.gateway`, the routers, the
way in for the streaming POST routes (`FastPaths`) and around everything `Cors`, `/metrics`, and the one place where errors raised
in routes become HTTP responses (`CoordinatorError` -> the surface's error body, chosen by path:
Anthropic's under `/v1/messages`, OpenAI's shape under the rest of `/v1/`, `ErrorBody` elsewhere; status from errors.STATUS_BY_REASON,
`X-Request-ID`, and `Retry-After` on 503).
Must not: read the environment or hold module-level state; everything comes in through arguments.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.admission.limits import with_ratelimit_headers
from coordinator.auth import CLIENT, TENANT
from coordinator.batches.room import room_in
from coordinator.batches.runner import Pace, Runner
from coordinator.batches.store import Bounds, Store
from coordinator.clock import Clock, SystemClock
from coordinator.errors import CoordinatorError
from coordinator.gateway import Gateway
from coordinator.ops import health, status_page
from coordinator.ops.cors import Cors, parse_origins
from coordinator.settings import Settings
from coordinator.state import CoordinatorState, build_state
from coordinator.surfaces import (
    anthropic,
    batches,
    embeddings,
    files,
    infer,
    openai,
    responses,
    responses_compact,
    responses_socket,
    responses_stored,
    sessions,
    tokenizer,
)
from coordinator.surfaces.sessions import PREFIX as SESSIONS_PREFIX
from coordinator.upstream import WorkerClient
from coordinator.validate import request_id_of
from protocol import reasons
from serving.edge import EdgeLimits
from serving.tracing import Tracing

log = logging.getLogger("coordinator")


def create_app(settings: Settings, *, clock: Clock | None = None,
               worker_client: WorkerClient | None = None, tracing: Tracing | None = None) -> FastAPI:
    """`worker_client` replaces the network to workers (tests pass fake workers). `tracing`: where this
    coordinator's spans go (serving/tracing.py; `Tracing.from_env` makes it from OTEL_*), None: nowhere."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.worker_token:
            log.warning('{"event": "no_worker_token", "detail": "heartbeats are not authenticated: anyone who can '
                        'reach this coordinator can register a worker; set WORKER_TOKEN"}')
        state = build_state(settings, clock or SystemClock(), worker_client, tracing)
        app.state.coordinator = state
        app.state.gateway = Gateway(state)
        app.state.responses_sockets = responses_socket.Sockets(settings.responses_sockets)
        directory = Path(settings.batch_dir or tempfile.mkdtemp(prefix="llm-pool-batches-"))
        app.state.batch_store = store = Store(directory, batch_bounds(settings))
        app.state.batch_runner = runner = Runner(
            store, batches.caller(app), room_in(state), clock=state.clock,
            pace=Pace(settings.batch_lease, settings.batch_jobs, settings.batch_max_in_flight),
            ready=lambda: state.readiness.known() and not state.draining,
            on_fault=state.metrics.internal_errors.labels(task="batch_runner").inc)
        running = asyncio.create_task(runner.run())  # supervised: Runner.run logs and counts its faults
        try:
            yield
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await runner.close()
            store.close()
            if not settings.batch_dir:
                shutil.rmtree(directory, ignore_errors=True)
            await state.mover.close()
            await state.stored.close()
            await state.client.close()
            state.cache.close()
            if tracing is not None:
                tracing.shutdown()  # the spans still queued go out now

    app = FastAPI(title="llm-pool coordinator", lifespan=lifespan)
    app.include_router(health.router)
    app.include_router(infer.router)
    app.include_router(openai.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(anthropic.router)
    app.include_router(responses_socket.router)
    app.include_router(responses_stored.router)
    app.include_router(responses_compact.router)
    app.include_router(sessions.router)
    app.include_router(tokenizer.router)
    app.include_router(status_page.router)
    app.add_middleware(FastPaths)
    app.add_middleware(Cors, origins=parse_origins(settings.cors_origins))  # outermost: before the keys
    app.add_exception_handler(CoordinatorError, _coordinator_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        state: CoordinatorState = request.app.state.coordinator
        state.registry.sweep(state.clock.monotonic())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


Handler = Callable[[Request], Awaitable[Response]]
ErrorResponder = Callable[[str, CoordinatorError], Response]
# POST path -> (handler, that surface's error body). The handlers answer their own refusals.
FAST_ROUTES: dict[str, tuple[Handler, ErrorResponder]] = {
    "/coordinator/infer": (infer.infer, infer.error_response),
    openai.CHAT_PATH: (openai.chat_completions, openai.error_response),
    openai.COMPLETIONS_PATH: (openai.completions, openai.error_response),
    responses.PATH: (responses.create, openai.error_response),
    anthropic.PATH: (anthropic.create, anthropic.error_response),
    health.HEARTBEAT_PATH: (health.heartbeat_response, infer.error_response),
}
# The OpenAI routes also answer without the /v1 prefix, as llama.cpp's server does (clients and its own
# test suite call `/chat/completions`): the same route, keys and all.
UNVERSIONED = frozenset({"/chat/completions", "/completions", "/embeddings", "/responses", "/models"})


_CHECKED = ("http", "websocket")  # the scopes the gate lets in or refuses (a WebSocket at its handshake)


class FastPaths:
    """The streaming POST routes, and the heartbeats (every worker's to every coordinator), go straight
    to their handlers, ahead of FastAPI's router and most of its middleware; every other request goes
    on to them.

    Why: a streamed response runs inside the call stack that reached it for as long as it streams,
    and each token's `send` passes back out through that stack's wrappers. Behind FastAPI's router
    that stack is about fifteen frames deep (exception middleware, exit stack, router, route,
    request/response adapters), held by every open stream and crossed by every token.
    Outside it stay only Starlette's ServerErrorMiddleware (so an unexpected error still reaches
    `_unexpected`) and two thin wrappers FastAPI puts next to it. The FastAPI routes stay registered,
    so the OpenAPI schema lists them and other methods get 405, but no POST reaches them.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind in _CHECKED and (scope["path"] in UNVERSIONED or scope["path"].startswith("/models/")):
            raw = scope.get("raw_path") or scope["path"].encode()
            scope = {**scope, "path": "/v1" + scope["path"], "raw_path": b"/v1" + raw}
        if kind in _CHECKED and not _let_in(scope):
            exc = CoordinatorError(reasons.UNAUTHORIZED, "an API key is needed: Authorization: Bearer <key>, or X-API-Key")
            # A WebSocket's handshake (the Responses API's) gets the same 401, in OpenAI's shape.
            refusal = error_response(Request(scope, receive), exc) if kind == "http" else openai.error_response("", exc)
            refusal.headers["www-authenticate"] = "Bearer"
            if kind == "http":
                await refusal(scope, receive, send)
            else:
                await responses_socket.refuse_handshake(scope, receive, send, refusal)
            return
        client = scope.get("state", {}).get(CLIENT) if kind == "http" else None
        if client is not None and client.limits.any:  # its x-ratelimit-* on every answer, not only a 429
            send = with_ratelimit_headers(send, scope["app"].state.coordinator.limits, client)
        route = FAST_ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        response = await self._respond(scope, receive, *route)
        await response(scope, receive, send)

    @staticmethod
    async def _respond(scope: Scope, receive: Receive, handler: Handler, on_error: ErrorResponder) -> Response:
        """The response, with the `Request` gone by the time it streams."""
        request = Request(scope, receive)
        try:
            return await handler(request)
        except CoordinatorError as exc:
            return on_error(request_id_of(request), exc)


def batch_bounds(settings: Settings) -> Bounds:
    return Bounds(file_bytes=settings.batch_file_max_bytes, file_lines=settings.batch_file_max_lines,
                  tenant_files=settings.batch_tenant_max_files, tenant_bytes=settings.batch_tenant_max_bytes,
                  retention=settings.batch_retention)


HEARTBEAT_MAX_BYTES = 96 * 1024  # the largest the protocol allows is 98,109 bytes (tests/coordinator/pool/test_heartbeat.py)


def edge_limits(settings: Settings) -> EdgeLimits:
    """What serving/edge.py enforces before a request reaches this app; its refusals in the same
    body shapes as the app's own (OpenAI's under `/v1/`)."""

    def render(path: str, status: int, reason: str, message: str) -> tuple[bytes, bytes]:
        exc = CoordinatorError(reason, message, status=status)
        return b"application/json", bytes(responder(path)("", exc).body)

    return EdgeLimits(max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes,
                      max_headers=settings.max_headers, header_timeout=settings.header_timeout,
                      body_timeout=settings.body_timeout,
                      path_body_limits={health.HEARTBEAT_PATH: HEARTBEAT_MAX_BYTES,
                                        files.PATH: settings.batch_file_max_bytes + files.UPLOAD_OVERHEAD}, render=render)


def _let_in(scope: Scope) -> bool:
    """Client API keys (coordinator/auth.py), when configured: on the generation surfaces and the
    tokenizer's routes (they reach workers), and (unless
    `open_metrics`) on /metrics and the status page's snapshot; health, the page itself (it holds no
    data, and asks for a key) and heartbeats (the worker token's) stay open. The key's tenant goes in
    the request's state for the surfaces (`tenant_of`)."""
    state: CoordinatorState | None = getattr(scope["app"].state, "coordinator", None)
    if state is None or state.api_keys is None:
        return True
    path = scope["path"]
    if not (path == "/coordinator/infer" or path.startswith(("/v1/", SESSIONS_PREFIX)) or path in tokenizer.PATHS
            or (path in ("/metrics", "/coordinator/status") and not state.settings.open_metrics)):
        return True
    found = state.api_keys.identify(Headers(scope=scope))
    if found is None:
        state.metrics.unauthorized.inc()
        return False
    state.metrics.requests_by_key.labels(key_id=found.key_id).inc()
    scope_state = scope.setdefault("state", {})
    scope_state[TENANT], scope_state[CLIENT] = found.tenant, found
    return True


def responder(path: str) -> ErrorResponder:
    """The error body of the surface `path` belongs to: Anthropic's under `/v1/messages`, OpenAI's under
    the rest of `/v1/`, the coordinator's own elsewhere."""
    if path == anthropic.PATH or path.startswith(anthropic.PATH + "/"):
        return anthropic.error_response
    return openai.error_response if path.startswith(openai.PREFIX) else infer.error_response


def error_response(request: Request, exc: CoordinatorError) -> Response:
    return responder(request.url.path)(request_id_of(request), exc)


async def _coordinator_error(request: Request, exc: CoordinatorError) -> Response:
    return error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # Unknown routes and methods still get the one JSON error shape.
    reason = reasons.INVALID_REQUEST if exc.status_code < 500 else reasons.INTERNAL
    return error_response(request, CoordinatorError(reason, str(exc.detail), status=exc.status_code))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error", exc_info=exc)
    return error_response(request, CoordinatorError(reasons.INTERNAL, "internal error"))
