"""The worker's FastAPI app: `create_app(settings, clock=..., transport=...)`.

Owns: the lifespan that loads the model off the event loop and starts the runtime (in the first of
`app.state.slots`, worker/api/slots.py; empty while loading), the routes (routes.py) and their slot URLs
(`SlotPaths`), and the one place where errors become the documented JSON body (`WorkerError`, validation
errors, unknown routes).
Must not: read the environment or hold module-level state; the settings come in as an argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol import reasons
from serving.tracing import Tracing
from worker.api import records, routes, swap, tokenizer, transfer
from worker.api.routes import request_id_of
from worker.api.slots import SlotPaths, loaded
from worker.backends import load_model
from worker.backends.base import ModelBackend
from worker.errors import WorkerError
from worker.metrics import WorkerMetrics
from worker.models.folder import open_folder, rescan
from worker.runtime import WorkerRuntime, whole
from worker.sessions.records import Records
from worker.settings import WorkerSettings
from worker.slots.slot import make_slots
from worker.slots.swapper import Swapper

log = logging.getLogger("worker.requests")


def create_app(settings: WorkerSettings, *, model: ModelBackend | None = None,
               clock: Callable[[], float] = time.monotonic, transport: httpx.AsyncBaseTransport | None = None,
               on_load_failure: Callable[[], None] = lambda: None, tracing: Tracing | None = None) -> FastAPI:
    """`model`: a model already loaded, as the settings' backend would load it, which the app uses and
    leaves open (tests share one across many apps, as the coordinator's tests share its client); None:
    the app loads its own from the settings and closes it at shutdown. `on_load_failure`: called once
    if the model cannot be loaded (the process entry point stops the server, so the worker exits
    non-zero instead of answering 503 loading forever). `tracing`: where this worker's spans go
    (serving/tracing.py; `Tracing.from_env` makes it from OTEL_*), None: nowhere."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.slots = make_slots(settings)  # slot 0 loads the first model; the others wait for a load
        app.state.swapper = None  # made once the first model is served (worker/slots/swapper.py)
        app.state.load_error = None
        app.state.metrics = WorkerMetrics()
        app.state.tracing = tracing
        loading = asyncio.create_task(_load(app))
        yield
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loading
        if app.state.swapper is not None:
            await app.state.swapper.close()
        for runtime in loaded(app):
            await runtime.stop()
        if tracing is not None:
            tracing.shutdown()  # the spans still queued go out now

    async def _load(app: FastAPI) -> None:
        def lost(why: str) -> None:  # a swap left no model: recorded, and the server stops
            app.state.load_error = why
            on_load_failure()

        try:
            # A folder (--model-dir) is read first: it may choose the model to serve.
            chosen, offers = await asyncio.to_thread(open_folder, settings)
            app.state.settings = chosen
            app.state.slots[0].settings = chosen

            async def build(wanted: WorkerSettings, given: ModelBackend | None = None) -> WorkerRuntime:
                # Whole even when the stop comes meanwhile: nothing is freed while a thread still uses it.
                loaded = given if given is not None else await whole(functools.partial(load_model, wanted),
                                                                     lambda model: model.close())
                try:
                    built = await whole(functools.partial(WorkerRuntime, wanted, loaded, app.state.metrics, clock=clock,
                                                          owns_model=given is None, offers=offers), WorkerRuntime.discard)
                except BaseException:
                    if given is None:
                        loaded.close()
                    raise
                await built.start(transport)
                return built

            runtime = await build(chosen, model)
            app.state.swapper = Swapper(app.state.slots, chosen, app.state.metrics, offers, build, on_lost=lost)
            if settings.model_dir is not None and settings.model_rescan > 0:
                app.state.swapper.watch(functools.partial(rescan, settings, {}), settings.model_rescan)
            if settings.model_dir is not None:  # WORKER_KEEP_ALIVE, or a request's keep_alive
                app.state.swapper.keep_alive()
        except Exception as exc:
            # Answering 503 loading forever would hide it: record why and stop the process (non-zero exit).
            log.exception("worker failed to start")
            app.state.load_error = f"{type(exc).__name__}: {exc}"
            on_load_failure()
            raise
        app.state.slots[0].served(runtime, chosen)
        log.info(json.dumps({"event": "ready", "worker_id": chosen.worker_id, "model": runtime.names.name,
                             "aliases": runtime.names.aliases,
                             "kv_capacity_tokens": runtime.table.limits.capacity_tokens,
                             "session_max_tokens": runtime.table.limits.session_max_tokens}))

    app = FastAPI(title="llm-pool worker", lifespan=lifespan)

    app.state.settings = settings
    app.state.records = Records(per_tenant=settings.responses_per_tenant,
                                bytes_per_tenant=settings.responses_bytes_per_tenant, ttl=settings.responses_ttl,
                                clock=clock)
    app.add_exception_handler(WorkerError, _worker_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.include_router(routes.router)
    app.include_router(transfer.router)
    app.include_router(records.router)
    app.include_router(tokenizer.router)
    app.include_router(swap.router)
    if settings.max_models > 1:  # one slot: no slot URLs, and nothing more on any request's path
        app.add_middleware(SlotPaths, count=settings.max_models)
    return app


async def _worker_error(request: Request, exc: WorkerError) -> JSONResponse:
    request_id = getattr(request.state, "request_id", "") or request_id_of(request)
    return exc.to_response(request_id)

async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                         for e in exc.errors())
    return WorkerError(reasons.INVALID_REQUEST, problems).to_response(request_id_of(request))

async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods get the documented error body too, not FastAPI's {"detail": ...}.
    return WorkerError.from_http(exc.status_code, str(exc.detail)).to_response(request_id_of(request))

