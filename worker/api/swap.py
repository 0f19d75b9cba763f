"""Swapping the model a worker serves for another of its folder (`--model-dir`, issue 37), without
cutting a stream: `POST /worker/models/load`.

Owns: the one swap a worker runs at a time (a second request for the same model joins it; one for a
third model is told which swap runs), and its order: the served model drains as at SIGTERM, but with
the longest a request may run as its deadline, so no stream is cut (new requests get 503 `draining`
and go to other workers; the coordinator moves kept sessions to other workers of the model, as for
any draining worker, and a session left is ended: its next turn gets 404); then it is closed, and
the asked-for model loaded in its place, with the worker's settings. A model that fails to load
is refused with 503 `model_load_failed` and its reason for MODEL_LOAD_BACKOFF seconds, and the model served
before is loaded again.
Must not: judge the folder's files (worker/models/) or build a runtime (app.py hands in `build`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from protocol import reasons
from protocol.worker import MODEL_LOAD_BACKOFF, MODEL_LOAD_PATH, ErrorBody, ModelLoadAnswer, ModelLoadRequest
from worker.api.routes import authorize
from worker.errors import WorkerError
from worker.models.catalog import Offer
from worker.runtime import WorkerRuntime
from worker.settings import WorkerSettings

log = logging.getLogger("worker.swap")
router = APIRouter()
Build = Callable[[WorkerSettings], Awaitable[WorkerRuntime]]


class Swapper:
    """`load(name)`: the model served now, or the swap to it started (or joined)."""

    def __init__(self, app: FastAPI, offers: Sequence[Offer], build: Build,
                 clock: Callable[[], float] = time.monotonic, on_lost: Callable[[], None] = lambda: None) -> None:
        """`on_lost`: called when a swap leaves the worker serving nothing (the model before could not be
        loaded again either): the process entry point stops the server, as when the first load fails."""
        self._app, self._offers, self._build, self._clock = app, list(offers), build, clock
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self._target = ""
        self._failed: dict[str, tuple[float, str]] = {}  # model -> (refused until, why it failed)

    @property
    def swapping(self) -> str:
        """The model being swapped to, or ""."""
        return self._target if self._task is not None and not self._task.done() else ""

    def load(self, name: str) -> ModelLoadAnswer:
        if self.swapping:
            if (asked := self._offer(name)) is not None and asked is self._offer(self.swapping):
                return ModelLoadAnswer(model=self.swapping, state="loading")
            raise WorkerError(409, reasons.MODEL_SWAPPING, f"this worker is swapping to {self.swapping!r}; ask "
                                                          "again once it serves it")
        runtime: WorkerRuntime | None = self._app.state.runtime
        if runtime is None:
            raise WorkerError(503, reasons.LOADING, "the model is still loading")
        if runtime.names.serves(name):
            return ModelLoadAnswer(model=runtime.names.name, state="loaded")
        offer = self._offer(name)
        if offer is None or offer.names is None:
            raise WorkerError(404, reasons.UNKNOWN_MODEL, f"model {name!r} is not in this worker's folder")
        if offer.state != "offered":
            raise WorkerError(400, reasons.INVALID_REQUEST, f"model {name!r} is {offer.state}: {offer.reason}")
        model = offer.names.name
        until, why = self._failed.get(model, (0.0, ""))
        if self._clock() < until:
            raise WorkerError(503, reasons.MODEL_LOAD_FAILED, f"model {model!r} failed to load ({why}); tried "
                                                              f"again in {until - self._clock():.0f} s")
        self._target = model
        self._task = asyncio.create_task(self._supervised(runtime, offer, model))
        return ModelLoadAnswer(model=model, state="loading")

    def _offer(self, name: str) -> Offer | None:
        return next((o for o in self._offers if o.names is not None and o.names.serves(name)), None)

    async def _supervised(self, old: WorkerRuntime, offer: Offer, model: str) -> None:
        """The swap, with any failure logged and counted; a worker left serving nothing stops."""
        try:
            await self._swap(old, offer, model)
        except Exception:
            log.exception("the swap to %s failed", model)
            old.metrics.internal_errors.labels(task="swap").inc()
            if self._app.state.runtime is None:
                self._app.state.load_error = f"the swap to {model} left no model loaded"
                self._on_lost()

    async def _swap(self, old: WorkerRuntime, offer: Offer, model: str) -> None:
        app, metrics = self._app, old.metrics
        settings: WorkerSettings = app.state.settings
        started = self._clock()
        log.warning(json.dumps({"event": "swap", "from": old.names.name, "to": model, "streams": len(old.jobs)}))
        await old.drain(settings.request_timeout)  # every request ends within it: none is cut
        app.state.runtime = None
        await old.stop()
        drained = self._clock()
        wanted = settings.model_copy(update={"model_path": offer.path, "model_name": "", "model_aliases": ()})
        try:
            runtime, outcome = await self._build(wanted), "loaded"
        except Exception as exc:
            self._failed[model] = (self._clock() + MODEL_LOAD_BACKOFF, f"{type(exc).__name__}: {exc}"[:200])
            log.exception("model %s failed to load; loading %s again", model, old.names.name)
            wanted, outcome = settings, "failed"
            runtime = await self._build(settings)
        app.state.settings, app.state.runtime = wanted, runtime
        metrics.model_swaps.labels(outcome).inc()
        metrics.model_swap_seconds.labels("wait").set(drained - started)
        metrics.model_swap_seconds.labels("load").set(self._clock() - drained)
        log.warning(json.dumps({"event": "swapped", "to": runtime.names.name, "outcome": outcome,
                                "wait_s": round(drained - started, 3), "load_s": round(self._clock() - drained, 3)}))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


@router.post(MODEL_LOAD_PATH, response_model=ModelLoadAnswer,
             responses={202: {"model": ModelLoadAnswer, "description": "the swap to it is under way"},
                        **{status: {"model": ErrorBody, "description": text} for status, text in {
                            400: "`invalid_request`: the model is `unavailable` or `too_large` (its reason named)",
                            401: "`unauthorized`", 404: "`unknown_model`: not in the worker's folder",
                            409: "`model_swapping`: a swap to another model is under way",
                            503: "`loading`, or `model_load_failed` (its reason; refused for a while)"}.items()}})
async def load(body: ModelLoadRequest, request: Request) -> JSONResponse:
    """Serve another model of the folder, once the one served now has finished its streams."""
    authorize(request)
    swapper: Swapper | None = getattr(request.app.state, "swapper", None)
    if swapper is None:
        raise WorkerError(503, reasons.LOADING, "the model is still loading")
    answer = swapper.load(body.model)
    return JSONResponse(answer.model_dump(), status_code=200 if answer.state == "loaded" else 202)
