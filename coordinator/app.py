"""The coordinator's FastAPI app: `create_app(settings, clock=..., worker_client=...)`.

Owns: the lifespan that builds `app.state.coordinator`, the routers, the way in for
`POST /coordinator/infer` (`InferFastPath`), `/metrics`, and the one place
where errors become HTTP responses (`CoordinatorError` -> JSON `ErrorBody` with the status from
errors.STATUS_BY_REASON, `X-Request-ID`, and `Retry-After` on 503).
Must not: read the environment or hold module-level state; everything comes in through arguments.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator import health, infer
from coordinator.clock import Clock, SystemClock
from coordinator.errors import CoordinatorError
from coordinator.settings import Settings
from coordinator.state import CoordinatorState, build_state
from coordinator.upstream import WorkerClient
from coordinator.validate import request_id_of
from protocol import reasons
from protocol.inference import ErrorBody

log = logging.getLogger("coordinator")


def create_app(settings: Settings, *, clock: Clock | None = None,
               worker_client: WorkerClient | None = None) -> FastAPI:
    """`worker_client` replaces the network to workers (tests pass fake workers)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings, clock or SystemClock(), worker_client)
        app.state.coordinator = state
        try:
            yield
        finally:
            await state.client.close()

    app = FastAPI(title="llm-pool coordinator", lifespan=lifespan)
    app.include_router(health.router)
    app.include_router(infer.router)
    app.add_middleware(InferFastPath)
    app.add_exception_handler(CoordinatorError, _coordinator_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: CoordinatorState = request.app.state.coordinator
        state.registry.sweep(state.clock.monotonic())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class InferFastPath:
    """`POST /coordinator/infer` goes straight to its handler, ahead of FastAPI's router and most of
    its middleware; every other request goes on to them.

    Why: a streamed response runs inside the call stack that reached it for as long as it streams,
    and each token's `send` passes back out through that stack's wrappers. Behind FastAPI's router
    that stack is about fifteen frames deep (exception middleware, exit stack, router, route,
    request/response adapters), held by every open stream and crossed by every token.
    Outside it stay only Starlette's ServerErrorMiddleware (so an unexpected error still reaches
    `_unexpected`) and two thin wrappers FastAPI puts next to it. The FastAPI route stays registered, so the OpenAPI schema lists it and other
    methods get 405, but no POST reaches it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/coordinator/infer":
            await self.app(scope, receive, send)
            return
        response = await self._respond(scope, receive)
        await response(scope, receive, send)

    @staticmethod
    async def _respond(scope: Scope, receive: Receive) -> Response:
        """The response, with the `Request` gone by the time it streams."""
        request = Request(scope, receive)
        try:
            return await infer.infer(request)
        except CoordinatorError as exc:
            return error_response(request, exc)


def error_response(request: Request, exc: CoordinatorError) -> JSONResponse:
    request_id = request_id_of(request)
    headers = {"x-request-id": request_id}
    if exc.retry_after is not None:
        headers["retry-after"] = str(exc.retry_after)
    if exc.status == 401:
        headers["www-authenticate"] = "Bearer"
    body = ErrorBody(error=exc.message, reason=exc.reason, request_id=request_id)
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


async def _coordinator_error(request: Request, exc: CoordinatorError) -> JSONResponse:
    return error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods still get the one JSON error shape.
    reason = reasons.INVALID_REQUEST if exc.status_code < 500 else reasons.INTERNAL
    return error_response(request, CoordinatorError(reason, str(exc.detail), status=exc.status_code))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response(request, CoordinatorError(reasons.INTERNAL, "internal error"))
