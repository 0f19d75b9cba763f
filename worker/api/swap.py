"""Swapping the model a worker serves for another of its folder (`--model-dir`, issue 37), without
cutting a stream: `POST /worker/models/load`.

Owns: the one swap a worker runs at a time (a second request for the same model joins it; one for a
third model is told which swap runs), and its order: the served model drains as at SIGTERM, but with
the longest a request may run as its deadline, so no stream is cut (new requests get 503 `model_swapping`
and go to other workers or wait; the coordinator moves kept sessions to other workers of the model, as for
any draining worker, and a session left is ended: its next turn gets 404); then it is closed, and
the asked-for model loaded in its place, with the worker's settings; meanwhile the worker's heartbeats
go on, saying it drains and holds nothing, so coordinators keep it and its folder (requests for either
model wait for the swap in the coordinator's queue rather than find no worker). A model that fails to load
is refused with 503 `model_load_failed` and its reason for MODEL_LOAD_BACKOFF seconds, and the model served
before is loaded again. And the folder's watch (`watch`, every WORKER_MODEL_RESCAN seconds): its offers
read again (new files offered, removed ones no longer), and a served model whose file was replaced or
written over (its identity digest differs from the loaded model's) or removed is never served on from
the stale mapping: the worker swaps, as above, to the file now there, or, with none, to the first
model offered; with no model left to serve it drains and stops.
And the keep-alive (`keep_alive`: WORKER_KEEP_ALIVE, or the latest request's `keep_alive`, as Ollama's):
a model with no request and no kept session for that long is drained and closed as for a swap, and the
worker holds no model (standby): the closed runtime's heartbeats go on, saying `standby` with the folder
and nothing loaded, until a load is asked for, which builds the runtime of the model asked for; one that
fails to load leaves it in standby. Each swap, unload or load ends by giving the memory of the runtime
before back to the system.
Must not: judge the folder's files (worker/models/) or build a runtime (app.py hands in `build`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from protocol import reasons
from protocol.worker import MODEL_LOAD_BACKOFF, MODEL_LOAD_PATH, ErrorBody, ModelLoadAnswer, ModelLoadRequest
from worker.api.routes import authorize
from worker.errors import WorkerError
from worker.models import folder
from worker.models.catalog import Offer
from worker.runtime import WorkerRuntime
from worker.settings import WorkerSettings

log = logging.getLogger("worker.swap")
router = APIRouter()
KEEP_ALIVE_LOOK = 0.25  # seconds between two looks at whether the model served is idle past its keep-alive
Build = Callable[[WorkerSettings], Awaitable[WorkerRuntime]]


class Swapper:
    """`load(name)`: the model served now, or the swap to it started (or joined)."""

    def __init__(self, app: FastAPI, offers: Sequence[Offer], build: Build,
                 clock: Callable[[], float] = time.monotonic, on_lost: Callable[[], None] = lambda: None,
                 give_back: Callable[[], None] | None = None) -> None:
        """`on_lost`: called when a swap leaves the worker serving nothing (the model before could not be
        loaded again either): the process entry point stops the server, as when the first load fails.
        `give_back`: returns what a closed runtime held to the system (`give_back_freed_memory`; a test
        process, whose collector would walk every test's objects, may hand in its own)."""
        self._app, self._offers, self._build, self._clock = app, list(offers), build, clock
        self._on_lost = on_lost
        self._give_back = give_back or give_back_freed_memory
        self._task: asyncio.Task[None] | None = None
        self._target = ""
        self._failed: dict[str, tuple[float, str]] = {}  # model -> (refused until, why it failed)
        self._watching: asyncio.Task[None] | None = None
        self._idle_watch: asyncio.Task[None] | None = None
        self._standby: WorkerRuntime | None = None  # the closed runtime that beats while no model is loaded

    @property
    def swapping(self) -> str:
        """The model being swapped to, or ""."""
        return self._target if self._busy else ""

    @property
    def _busy(self) -> bool:
        """A swap, unload or load runs."""
        return self._task is not None and not self._task.done()

    @property
    def standby(self) -> str:
        """The model unloaded after the keep-alive while no other is loaded yet, or ""."""
        return self._standby.names.name if self._standby is not None else ""

    def load(self, name: str) -> ModelLoadAnswer:
        if self._busy:
            if self._target and (asked := self._offer(name)) is not None and asked is self._offer(self._target):
                return ModelLoadAnswer(model=self._target, state="loading")
            doing = f"swapping to {self._target!r}" if self._target else "unloading its idle model"
            raise WorkerError(409, reasons.MODEL_SWAPPING, f"this worker is {doing}; ask again once it is done")
        runtime: WorkerRuntime | None = self._app.state.runtime
        if runtime is None and self._standby is None:
            raise WorkerError(503, reasons.LOADING, "the model is still loading")
        if runtime is not None and runtime.names.serves(name):
            return ModelLoadAnswer(model=runtime.names.name, state="loaded")
        offer = self._loadable(name)
        model = offer.names.name if offer.names is not None else name
        if runtime is None:
            self._target = model
            self._task = asyncio.create_task(self._guarded(self._wake(offer, model), f"load of {model}"))
        else:
            self._start(runtime, offer, "asked")
        return ModelLoadAnswer(model=model, state="loading")

    def _loadable(self, name: str) -> Offer:
        """The folder's offer `name` names, or why it cannot be loaded now (a `WorkerError`)."""
        offer = self._offer(name)
        if offer is None or offer.names is None:
            raise WorkerError(404, reasons.UNKNOWN_MODEL, f"model {name!r} is not in this worker's folder")
        if offer.state != "offered":
            raise WorkerError(400, reasons.INVALID_REQUEST, f"model {name!r} is {offer.state}: {offer.reason}")
        until, why = self._failed.get(offer.names.name, (0.0, ""))
        if self._clock() < until:
            raise WorkerError(503, reasons.MODEL_LOAD_FAILED, f"model {offer.names.name!r} failed to load ({why}); "
                                                              f"tried again in {until - self._clock():.0f} s")
        return offer

    def _start(self, runtime: WorkerRuntime, offer: Offer, why: str) -> None:
        assert offer.names is not None
        self._target = offer.names.name
        self._task = asyncio.create_task(self._guarded(self._swap(runtime, offer, offer.names.name, why),
                                                       f"swap to {offer.names.name}"))

    def keep_alive(self, every: float = KEEP_ALIVE_LOOK) -> None:
        """Unloads the model served once it has been idle its runtime's `keep_alive` (`WorkerRuntime.idle_for`:
        no request and no kept session), looking every `every` seconds, for the worker's life."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(every)
                runtime: WorkerRuntime | None = self._app.state.runtime
                if (runtime is not None and not self._busy and runtime.keep_alive is not None
                        and runtime.idle_for() >= runtime.keep_alive):
                    self._target = ""
                    self._task = asyncio.create_task(self._guarded(self._unload(runtime), "unload"))

        self._idle_watch = asyncio.create_task(loop())

    def watch(self, read: Callable[[], Sequence[Offer]], every: float) -> None:
        """Reads the folder every `every` seconds (`read`, in a thread) for the worker's life, and
        `refresh`es with what it found; a failed read is logged and counted, and the next one tried."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    self.refresh(await asyncio.to_thread(read))
                except Exception:
                    log.exception("reading the model folder failed")
                    self._app.state.metrics.internal_errors.labels(task="folder_watch").inc()

        self._watching = asyncio.create_task(loop())

    def refresh(self, offers: Sequence[Offer]) -> None:
        """The folder as read now: its offers replace the ones before (the heartbeats list them), and a
        served model whose file is not the one loaded any more is swapped for the file there now, else
        for the first model offered, else drained and stopped. Nothing while a swap runs (the next read
        sees what it left)."""
        self._offers = list(offers)
        if self._standby is not None and self._standby.heartbeats is not None:
            self._standby.heartbeats.offered = folder.listed(self._offers, None, self._standby.names)
        runtime: WorkerRuntime | None = self._app.state.runtime
        if runtime is None or self._busy:
            return  # a swap or unload runs: the next read sees what it left
        runtime.offer(self._offers)
        changed = self._file_change(runtime)
        if changed is None:
            return
        now, target = changed
        log.warning(json.dumps({"event": "model_file_changed", "model": runtime.names.name,
                                "file": str(self._app.state.settings.model_path), "now": now,
                                "next": target.path.name if target is not None else None}))
        if target is not None:
            self._start(runtime, target, f"file_{now}")
        else:
            self._target = runtime.names.name
            self._task = asyncio.create_task(self._retire(runtime))

    def _file_change(self, runtime: WorkerRuntime) -> tuple[str, Offer | None] | None:
        """None while the served model's file is the one loaded (or not the folder's to watch); else what
        became of it (`replaced`, `gone`, or its verdict now) and the offer to serve instead (None: none)."""
        served: Path = self._app.state.settings.model_path
        folder: Path | None = self._app.state.settings.model_dir
        if folder is None or not _inside(served, folder):
            return None  # a --model outside the folder is not the folder's to watch
        there = next((o for o in self._offers if o.path.name == served.name), None)
        if there is not None and there.state == "offered":
            return None if there.identity == runtime.model.identity else ("replaced", there)
        return ("gone" if there is None else there.state), next((o for o in self._offers if o.state == "offered"), None)

    def _offer(self, name: str) -> Offer | None:
        return next((o for o in self._offers if o.names is not None and o.names.serves(name)), None)

    async def _guarded(self, work: Awaitable[None], what: str) -> None:
        """A swap, unload or load, with any failure logged and counted; a worker left with no model and
        no standby (which still beats and can load one) stops. Once it ends, what the runtime before
        held goes back to the system (`give_back_freed_memory`)."""
        try:
            await work
            await asyncio.to_thread(self._give_back)
        except Exception:
            log.exception("the %s failed", what)
            self._app.state.metrics.internal_errors.labels(task="swap").inc()
            if self._app.state.runtime is None and self._standby is None:
                self._app.state.load_error = f"the {what} left no model loaded"
                self._on_lost()

    async def _unload(self, old: WorkerRuntime) -> None:
        """Idle past the keep-alive: drained (a request that came in meanwhile ends whole) and closed as for
        a swap; its heartbeats go on, saying `standby`, with nothing loaded."""
        settings: WorkerSettings = self._app.state.settings
        log.warning(json.dumps({"event": "unload", "model": old.names.name, "idle_s": round(old.idle_for(), 1)}))
        if old.heartbeats is not None:  # the drain's first beat says so: no coordinator sends it more
            old.heartbeats.standby = True
            old.heartbeats.offered = folder.listed(self._offers, None, old.names)
        await old.drain(settings.request_timeout)
        self._app.state.runtime = None
        self._standby = old
        await old.stop(leaving=False)
        old.metrics.model_swaps.labels("unloaded").inc()

    async def _wake(self, offer: Offer, model: str) -> None:
        """From standby: the model asked for is loaded (its runtime's heartbeats replace the standby's); one
        that fails to load is refused for MODEL_LOAD_BACKOFF and the worker stays in standby."""
        standby, settings = self._standby, self._app.state.settings
        assert standby is not None
        started = self._clock()
        log.warning(json.dumps({"event": "load", "from": "standby", "to": model}))
        if standby.heartbeats is not None:
            standby.heartbeats.swapping = model
        wanted = _serving(settings, offer)
        try:
            runtime = await self._build(wanted)
        except Exception as exc:
            self._refuse_for_a_while(model, exc)
            log.exception("model %s failed to load; the worker stays in standby", model)
            standby.metrics.model_swaps.labels("failed").inc()
            if standby.heartbeats is not None:
                standby.heartbeats.swapping = ""
            return
        runtime.offer(self._offers)
        await standby.end_beats()
        self._standby = None
        self._served(runtime, wanted, "loaded", started, started)

    async def _retire(self, old: WorkerRuntime) -> None:
        """The served model's file is gone and the folder offers no other: its streams end whole, then
        the worker stops (as when its first load fails)."""
        settings: WorkerSettings = self._app.state.settings
        try:
            await old.drain(settings.request_timeout)
            await old.stop()
        finally:
            self._app.state.runtime = None
            self._app.state.load_error = f"the file of {old.names.name} is gone and the folder offers no other model"
            log.error(json.dumps({"event": "no_model_left", "model": old.names.name}))
            self._on_lost()

    async def _swap(self, old: WorkerRuntime, offer: Offer, model: str, why: str) -> None:
        app = self._app
        settings: WorkerSettings = app.state.settings
        started = self._clock()
        log.warning(json.dumps({"event": "swap", "from": old.names.name, "to": model, "why": why,
                                "streams": len(old.jobs)}))
        old.gate.swapping = model  # its refusals meanwhile say so (503 `model_swapping`, not `draining`)
        if old.heartbeats is not None:
            old.heartbeats.swapping = model  # and the drain's first beat, at once
        await old.drain(settings.request_timeout)  # every request ends within it: none is cut
        app.state.runtime = None
        await old.stop(leaving=False)  # its heartbeats go on (draining, holding nothing) until the next model's
        await asyncio.to_thread(self._give_back)
        drained = self._clock()
        wanted = _serving(settings, offer)
        try:
            try:
                runtime, outcome = await self._build(wanted), "loaded"
            except Exception as exc:
                self._refuse_for_a_while(model, exc)
                log.exception("model %s failed to load; loading %s again", model, old.names.name)
                wanted, outcome = settings, "failed"
                runtime = await self._build(settings)
            runtime.offer(self._offers)  # the folder as last read, before its first heartbeat
        finally:
            await old.end_beats()
        self._served(runtime, wanted, outcome, started, drained)

    def _refuse_for_a_while(self, model: str, failure: Exception) -> None:
        """`model` failed to load: asked for again, it is refused with why for MODEL_LOAD_BACKOFF."""
        self._failed[model] = (self._clock() + MODEL_LOAD_BACKOFF, f"{type(failure).__name__}: {failure}"[:200])

    def _served(self, runtime: WorkerRuntime, wanted: WorkerSettings, outcome: str, started: float,
                drained: float) -> None:
        """`runtime` serves now; the swap (or load) counted and logged: its wait, from `started` until the
        model before was `drained`, and its load since."""
        self._app.state.settings, self._app.state.runtime = wanted, runtime
        metrics = runtime.metrics
        metrics.model_swaps.labels(outcome).inc()
        metrics.model_swap_seconds.labels("wait").set(drained - started)
        metrics.model_swap_seconds.labels("load").set(self._clock() - drained)
        log.warning(json.dumps({"event": "swapped", "to": runtime.names.name, "outcome": outcome,
                                "wait_s": round(drained - started, 3), "load_s": round(self._clock() - drained, 3)}))

    async def close(self) -> None:
        for task in (self._watching, self._idle_watch, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._standby is not None:  # its last beat says it leaves, as a served runtime's stop does
            if self._standby.heartbeats is not None:
                await self._standby.heartbeats.send_once(leaving=True)
            await self._standby.end_beats()
            self._standby = None


def _serving(settings: WorkerSettings, offer: Offer) -> WorkerSettings:
    """The worker's settings, serving `offer`'s file under the names it derives from it."""
    return settings.model_copy(update={"model_path": offer.path, "model_name": "", "model_aliases": ()})


def give_back_freed_memory() -> None:
    """A closed runtime's objects hold each other in cycles (its table's, gate's and heartbeats' callbacks),
    which only Python's cyclic collector frees, and it runs when allocations cross its thresholds, not
    after a swap: after ten minutes of swaps a worker held 539 MB with its first model loaded again, and
    349 MB with this collection (bench/model_soak.py, docs/benchmarks.md). Then
    glibc keeps in its heaps what was freed; `malloc_trim` returns the free pages to the system
    (elsewhere, no glibc: nothing)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.parent.resolve() == folder.resolve()
    except OSError:
        return False


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
