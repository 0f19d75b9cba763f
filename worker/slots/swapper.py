"""Swapping the model a worker serves for another of its folder (`--model-dir`, issue 37), without
cutting a stream (`POST /worker/models/load`, worker/api/swap.py). With WORKER_MAX_MODELS > 1 the worker
serves a model in each of its slots (slot.py): a model asked for loads into a free slot, beside those
served and draining none, while they all fit the memory budget (`WORKER_MODEL_MEMORY`); else the least
wanted model's slot (idle first, the longest unused first; then the fewest streams) is swapped as below,
and more unloaded while that frees too little. Each slot's heartbeats say which offers would load beside
(`OfferedModel.beside`).

Owns: the one job a worker runs at a time on its slots (a load, swap, unload or drain: each moves the
slots it works on through their states, states.py; a second request for the same model joins it; one for
a third model is told which swap runs), and a swap's order: the served model drains as at SIGTERM, but
with the longest a request may run as its deadline, so no stream is cut (new requests get 503
`model_swapping` and go to other workers or wait; the coordinator moves kept sessions to other workers of
the model, as for any draining worker, and a session left is ended: its next turn gets 404); then it is
closed, and the asked-for model loaded in its place, with the worker's settings; meanwhile the worker's
heartbeats go on, saying it drains and holds nothing, so coordinators keep it and its folder (requests for
either model wait for the swap in the coordinator's queue rather than find no worker). A model that fails
to load is refused with 503 `model_load_failed` and its reason for MODEL_LOAD_BACKOFF seconds, and the
model served before is loaded again (one that fails too, beside other models served, leaves its slot
empty: its last beat says it leaves). And the folder's watch (`watch`, every WORKER_MODEL_RESCAN seconds):
its offers read again (new files offered, removed ones no longer), and a served model whose file was
replaced or written over (its identity digest differs from the loaded model's) or removed is never served
on from the stale mapping: the worker swaps, as above, to the file now there, or, with none, to the first
model offered that no other slot serves; with none, a slot beside others served is emptied, and the last
model served drains and the worker stops. And the keep-alive (`keep_alive`: WORKER_KEEP_ALIVE, or the
latest request's `keep_alive`, as Ollama's): a model with no request and no kept session for that long is
drained and closed as for a swap, its slot emptied while other models are served; the last one leaves the
worker holding no model (standby): the closed runtime's heartbeats go on, saying `standby` with the folder
and nothing loaded, until a load is asked for, which builds the runtime of the model asked for; one that
fails to load leaves it in standby. Each job ends by giving the memory of the runtime before back to the
system.
Every loop and job is supervised: an exception is logged with its traceback and counted
(worker_internal_errors_total{task}); a job that raised leaves each slot it worked on in the state of what
it holds then (`Slot.settle`: SERVING, STANDBY or EMPTY; none stays busy), and a worker left with no model
stops; a keep-alive look that raised changed no slot, and the next look is made.
Must not: judge the folder's files (worker/models/), build a runtime (app.py hands in `build`), change a
runtime's fields (its own methods do) or know HTTP.
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

from protocol import reasons
from protocol.worker import MODEL_LOAD_BACKOFF, ModelLoadAnswer
from worker.errors import WorkerError
from worker.metrics import WorkerMetrics
from worker.models import folder
from worker.models.catalog import Offer
from worker.runtime import WorkerRuntime, bind_gauges
from worker.settings import WorkerSettings
from worker.slots.slot import Slot, beating, others_serve

log = logging.getLogger("worker.swap")
KEEP_ALIVE_LOOK = 0.25  # seconds between two looks at whether the model served is idle past its keep-alive
Build = Callable[[WorkerSettings], Awaitable[WorkerRuntime]]


class Swapper:
    """`load(name)`: the model served now, or its load (into a free slot, or by a swap) started or joined."""

    def __init__(self, slots: Sequence[Slot], settings: WorkerSettings, metrics: WorkerMetrics,
                 offers: Sequence[Offer], build: Build, clock: Callable[[], float] = time.monotonic,
                 on_lost: Callable[[str], None] = lambda why: None,
                 give_back: Callable[[], None] | None = None) -> None:
        """`on_lost`: called once, with why, when a job leaves the worker serving nothing (the model before
        could not be loaded again either, or its file is gone): the app records why and the process entry
        point stops the server, as when the first load fails. `give_back`: returns what a closed runtime
        held to the system (`give_back_freed_memory`; a test process, whose collector would walk every
        test's objects, may hand in its own)."""
        self._slots, self._settings, self._metrics = list(slots), settings, metrics
        self._offers, self._build, self._clock = list(offers), build, clock
        self._on_lost, self._lost = on_lost, False
        self._give_back = give_back or give_back_freed_memory
        self._task: asyncio.Task[None] | None = None  # the job running, with its memory given back after
        self._failed: dict[str, tuple[float, str]] = {}  # model -> (refused until, why it failed)
        self._watching: asyncio.Task[None] | None = None
        self._idle_watch: asyncio.Task[None] | None = None
        self._relist()

    @property
    def swapping(self) -> str:
        """The model the job running brings in (or, for a changed file, takes away), or ""."""
        return next((s.target for s in self._slots if s.target), "") if self._busy else ""

    @property
    def _busy(self) -> bool:
        """A load, swap, unload or drain runs (or gives its memory back)."""
        return self._task is not None and not self._task.done()

    @property
    def standby(self) -> str:
        """The model unloaded after the keep-alive while no other is loaded yet, or ""."""
        return next((s.standby.names.name for s in self._slots if s.standby is not None), "")

    def load(self, name: str) -> ModelLoadAnswer:
        if self._busy:
            target = self.swapping
            if target and (asked := self._offer(name)) is not None and asked is self._offer(target):
                return ModelLoadAnswer(model=target, state="loading")
            doing = f"swapping to {target!r}" if target else "unloading its idle model"
            raise WorkerError(reasons.MODEL_SWAPPING, f"this worker is {doing}; ask again once it is done")
        if not beating(self._slots):
            raise WorkerError(reasons.LOADING, "the model is still loading")
        if (served := self._serving_now(name)) is not None:
            return ModelLoadAnswer(model=served.names.name, state="loaded")
        offer = self._loadable(name)
        model = offer.names.name if offer.names is not None else name
        standby = next((s for s in self._slots if s.standby is not None), None)
        if standby is not None:
            standby.loading(model)
            self._run(self._wake(standby, offer, model), f"load of {model}")
            return ModelLoadAnswer(model=model, state="loading")
        slot, others = self._room_for(offer)
        if slot.runtime is None:
            slot.loading(model)
            self._run(self._add(slot, offer, model), f"load of {model}")
        else:
            self._start(slot, offer, "asked", others)
        return ModelLoadAnswer(model=model, state="loading")

    def _run(self, job: Awaitable[None], what: str) -> None:
        self._task = asyncio.create_task(self._guarded(job, what))

    def _serving_now(self, name: str) -> WorkerRuntime | None:
        """The runtime serving the model `name` names, by its names or its folder's (the same file)."""
        offer = self._offer(name)
        return next((s.runtime for s in self._slots if s.runtime is not None and (
            s.runtime.names.serves(name) or offer is not None and offer.path == s.settings.model_path)), None)

    def _room_for(self, offer: Offer) -> tuple[Slot, list[Slot]]:
        """Where `offer` loads: a free slot while the models loaded and it fit the memory budget; else the
        slot of the least wanted model (idle ones first, the longest unused first; then the fewest streams),
        swapped, and, while that is not room enough, the next least wanted ones unloaded too."""
        loaded = [s for s in self._slots if s.runtime is not None]
        free = [s for s in self._slots if s.runtime is None]
        budget = folder.budget_bytes(self._settings)
        used = sum(self._need(s) for s in loaded)
        order = sorted(loaded, key=_least_wanted)
        out: list[Slot] = []
        while order and (not free and not out or used + offer.need_bytes > budget):
            out.append(order.pop(0))
            used -= self._need(out[-1])
        return (out[0], out[1:]) if out else (free[0], [])

    def _need(self, slot: Slot) -> int:
        """The memory the model `slot` serves takes, as its folder's offer says (its file's size, for a
        --model outside the folder)."""
        path = slot.settings.model_path
        offer = next((o for o in self._offers if o.path == path and o.state == "offered"), None)
        if offer is not None:
            return offer.need_bytes
        with contextlib.suppress(OSError):
            return path.stat().st_size
        return 0

    def _loadable(self, name: str) -> Offer:
        """The folder's offer `name` names, or why it cannot be loaded now (a `WorkerError`)."""
        offer = self._offer(name)
        if offer is None or offer.names is None:
            raise WorkerError(reasons.UNKNOWN_MODEL, f"model {name!r} is not in this worker's folder")
        if offer.state != "offered":
            raise WorkerError(reasons.INVALID_REQUEST, f"model {name!r} is {offer.state}: {offer.reason}")
        until, why = self._failed.get(offer.names.name, (0.0, ""))
        if self._clock() < until:
            raise WorkerError(reasons.MODEL_LOAD_FAILED, f"model {offer.names.name!r} failed to load ({why}); "
                                                         f"tried again in {until - self._clock():.0f} s")
        return offer

    def _start(self, slot: Slot, offer: Offer, why: str, others: Sequence[Slot] = ()) -> None:
        assert offer.names is not None
        slot.swapping(offer.names.name)
        for other in others:
            other.unloading()
        self._run(self._swap(slot, offer, offer.names.name, why, others), f"swap to {offer.names.name}")

    def keep_alive(self, every: float = KEEP_ALIVE_LOOK) -> None:
        """Unloads a model served once it has been idle its runtime's `keep_alive` (`WorkerRuntime.idle_for`:
        no request and no kept session), looking every `every` seconds, for the worker's life. A look that
        raises is logged and counted (task `keep_alive`); it changed no slot, and the next look is made."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    self._unload_idle()
                except Exception:
                    log.exception("the keep-alive's look failed")
                    self._metrics.internal_error("keep_alive")

        self._idle_watch = asyncio.create_task(loop())

    def _unload_idle(self) -> None:
        if self._busy:
            return
        idle = next((s for s in self._slots if s.runtime is not None and s.runtime.keep_alive is not None
                     and s.runtime.idle_for() >= s.runtime.keep_alive), None)
        if idle is not None:
            idle.unloading()
            self._run(self._unload(idle), "unload")

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
                    self._metrics.internal_error("folder_watch")

        self._watching = asyncio.create_task(loop())

    def refresh(self, offers: Sequence[Offer]) -> None:
        """The folder as read now: its offers replace the ones before (the heartbeats list them), and a
        served model whose file is not the one loaded any more is swapped for the file there now, else
        for the first model offered that no other slot serves; else, with another model served, its
        slot is emptied, and with none it is drained and the worker stops. Nothing while a job runs
        (the next read sees what it left)."""
        self._offers = list(offers)
        self._relist()
        if self._busy:
            return  # a job runs: the next read sees what it left
        for slot in self._slots:
            if slot.runtime is not None and (changed := self._file_change(slot)) is not None:
                self._changed(slot, *changed)
                return

    def _relist(self) -> None:
        """Every slot's heartbeats list the folder as last read, with the offers that would load beside the
        models served now (`_beside`)."""
        beside = self._beside()
        for slot in self._slots:
            for runtime in (slot.runtime, slot.standby):
                if runtime is not None:
                    runtime.offer(self._offers, beside)

    def _beside(self) -> set[Path]:
        """The files offered, not served, that a load would put in a free slot, unloading nothing (`_room_for`)."""
        if all(s.runtime is not None for s in self._slots):
            return set()
        served = {s.settings.model_path for s in self._slots if s.runtime is not None}
        return {o.path for o in self._offers
                if o.state == "offered" and o.path not in served and self._room_for(o)[0].runtime is None}

    def _changed(self, slot: Slot, now: str, target: Offer | None) -> None:
        runtime = slot.runtime
        assert runtime is not None
        log.warning(json.dumps({"event": "model_file_changed", "model": runtime.names.name,
                                "file": str(slot.settings.model_path), "now": now,
                                "next": target.path.name if target is not None else None}))
        if target is not None:
            self._start(slot, target, f"file_{now}")
        elif others_serve(self._slots, slot):
            slot.unloading(runtime.names.name)
            self._run(self._unload(slot), "unload")
        else:
            slot.draining(runtime.names.name)
            self._run(self._retire(slot), "drain")

    def _file_change(self, slot: Slot) -> tuple[str, Offer | None] | None:
        """None while the slot's model's file is the one loaded (or not the folder's to watch); else what
        became of it (`replaced`, `gone`, or its verdict now) and the offer to serve instead (None: none)."""
        assert slot.runtime is not None
        served, folder_path = slot.settings.model_path, slot.settings.model_dir
        if folder_path is None or not _inside(served, folder_path):
            return None  # a --model outside the folder is not the folder's to watch
        there = next((o for o in self._offers if o.path.name == served.name), None)
        if there is not None and there.state == "offered":
            return None if there.identity == slot.runtime.model.identity else ("replaced", there)
        return ("gone" if there is None else there.state), self._instead(slot)

    def _instead(self, slot: Slot) -> Offer | None:
        """The first model offered that no slot but `slot` serves (None: none)."""
        others = {s.settings.model_path for s in self._slots if s.runtime is not None and s is not slot}
        return next((o for o in self._offers if o.state == "offered" and o.path not in others), None)

    def _offer(self, name: str) -> Offer | None:
        return next((o for o in self._offers if o.names is not None and o.names.serves(name)), None)

    async def _guarded(self, work: Awaitable[None], what: str) -> None:
        """A job, with any failure logged and counted, and each slot it left busy settled in the state of
        what it holds (`Slot.settle`); a worker left with no model and no standby (which still beats and
        can load one) stops. Once it ends, what the runtime before held goes back to the system
        (`give_back_freed_memory`)."""
        try:
            await work
            await asyncio.to_thread(self._give_back)
        except Exception:
            log.exception("the %s failed", what)
            self._metrics.internal_error("swap")
            for slot in self._slots:
                if slot.busy:
                    slot.settle()
            if not beating(self._slots):
                self._lose(f"the {what} left no model loaded")
        finally:
            for slot in self._slots:
                slot.job_ended()

    def _lose(self, why: str) -> None:
        """The worker serves no model and has none in standby: the app is told why, once."""
        if not self._lost:
            self._lost = True
            self._on_lost(why)

    async def _unload(self, slot: Slot) -> None:
        """Idle past the keep-alive (or its file gone while another model is served, or making room for a
        swap): drained (a request that came in meanwhile ends whole) and closed as for a swap. The last
        model served leaves its heartbeats beating, saying `standby`, with nothing loaded; another one's last
        beat says it leaves."""
        old = slot.runtime
        assert old is not None
        last = not others_serve(self._slots, slot)
        log.warning(json.dumps({"event": "unload", "model": old.names.name, "slot": slot.index,
                                "idle_s": round(old.idle_for(), 1)}))
        if last:  # the drain's first beat says so: no coordinator sends it more
            old.stand_by(self._offers)
        await old.drain(slot.settings.request_timeout)
        if last:
            slot.stood_by(old)
        else:
            slot.emptied()
        await old.stop(leaving=not last)
        old.metrics.model_swaps.labels("unloaded").inc()
        self._bind_metrics()
        self._relist()

    async def _add(self, slot: Slot, offer: Offer, model: str) -> None:
        """Into a free slot, beside the models served: nothing drains. One that fails to load is refused for
        MODEL_LOAD_BACKOFF and the slot stays free."""
        started = self._clock()
        log.warning(json.dumps({"event": "load", "slot": slot.index, "to": model}))
        wanted = _serving(slot.settings, offer)
        try:
            runtime = await self._build(wanted)
        except Exception as exc:
            self._refuse_for_a_while(model, exc)
            log.exception("model %s failed to load into slot %d", model, slot.index)
            self._metrics.model_swaps.labels("failed").inc()
            slot.emptied()
            return
        self._served(slot, runtime, wanted, "added", started, started)

    async def _wake(self, slot: Slot, offer: Offer, model: str) -> None:
        """From standby: the model asked for is loaded (its runtime's heartbeats replace the standby's); one
        that fails to load is refused for MODEL_LOAD_BACKOFF and the worker stays in standby."""
        standby = slot.standby
        assert standby is not None
        started = self._clock()
        log.warning(json.dumps({"event": "load", "from": "standby", "to": model}))
        standby.swapping_to(model)
        wanted = _serving(slot.settings, offer)
        try:
            runtime = await self._build(wanted)
        except Exception as exc:
            self._refuse_for_a_while(model, exc)
            log.exception("model %s failed to load; the worker stays in standby", model)
            standby.metrics.model_swaps.labels("failed").inc()
            standby.swapping_to("")
            slot.stood_by(standby)
            return
        self._served(slot, runtime, wanted, "loaded", started, started)
        await standby.end_beats()

    async def _retire(self, slot: Slot) -> None:
        """The served model's file is gone and the folder offers no other: its streams end whole, then
        the worker stops (as when its first load fails)."""
        old = slot.runtime
        assert old is not None
        try:
            await old.drain(slot.settings.request_timeout)
            await old.stop()
        finally:
            slot.emptied()
            log.error(json.dumps({"event": "no_model_left", "model": old.names.name}))
            self._lose(f"the file of {old.names.name} is gone and the folder offers no other model")

    async def _swap(self, slot: Slot, offer: Offer, model: str, why: str, others: Sequence[Slot] = ()) -> None:
        """The slot's model drains (with `others`, unloaded to make room), is closed, and `model` loaded in its
        place; one that fails to load brings the model before back."""
        old, settings = slot.runtime, slot.settings
        assert old is not None
        started = self._clock()
        log.warning(json.dumps({"event": "swap", "from": old.names.name, "to": model, "why": why,
                                "slot": slot.index, "streams": len(old.jobs),
                                "unloading": [s.model for s in others]}))
        old.swapping_to(model)  # its refusals and the drain's first beat say so (503 `model_swapping`)
        # Every request ends within the drain: none is cut.
        await asyncio.gather(old.drain(settings.request_timeout), *(self._unload(s) for s in others))
        slot.closed()
        await old.stop(leaving=False)  # its heartbeats go on (draining, holding nothing) until the next model's
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
            self._served(slot, runtime, wanted, outcome, started, drained)
        finally:
            if slot.runtime is None and old.heartbeats is not None and len(self._slots) > 1:
                await old.heartbeats.send_once(leaving=True)  # nothing serves in this slot now
            await old.end_beats()

    def _refuse_for_a_while(self, model: str, failure: Exception) -> None:
        """`model` failed to load: asked for again, it is refused with why for MODEL_LOAD_BACKOFF."""
        self._failed[model] = (self._clock() + MODEL_LOAD_BACKOFF, f"{type(failure).__name__}: {failure}"[:200])

    def _served(self, slot: Slot, runtime: WorkerRuntime, wanted: WorkerSettings, outcome: str, started: float,
                drained: float) -> None:
        """`runtime` serves in `slot` now, every slot's heartbeats listing the folder as last read (before its
        first beat, whose registration asks the slot's health: no await comes between its build and this);
        the swap (or load) counted and logged: its wait, from `started` until the model before was
        `drained`, and its load since."""
        slot.served(runtime, wanted)
        self._bind_metrics()
        self._relist()
        metrics = runtime.metrics
        metrics.model_swaps.labels(outcome).inc()
        metrics.model_swap_seconds.labels("wait").set(drained - started)
        metrics.model_swap_seconds.labels("load").set(self._clock() - drained)
        log.warning(json.dumps({"event": "swapped", "to": runtime.names.name, "outcome": outcome, "slot": slot.index,
                                "wait_s": round(drained - started, 3), "load_s": round(self._clock() - drained, 3)}))

    def _bind_metrics(self) -> None:
        """With several slots, the worker's gauges (running, waiting, KV, sessions) add up every model served."""
        if len(self._slots) > 1:
            bind_gauges(self._metrics, lambda: [s.runtime for s in self._slots if s.runtime is not None])

    async def close(self) -> None:
        for task in (self._watching, self._idle_watch, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for slot in self._slots:
            if slot.standby is not None:  # its last beat says it leaves, as a served runtime's stop does
                standby = slot.emptied()
                assert standby is not None
                if standby.heartbeats is not None:
                    await standby.heartbeats.send_once(leaving=True)
                await standby.end_beats()


def _least_wanted(slot: Slot) -> tuple[bool, int, float]:
    """The order models are unloaded to make room: idle ones first, the longest unused first; then those
    with the fewest streams."""
    runtime = slot.runtime
    assert runtime is not None
    return runtime.idle_for() == 0.0, len(runtime.jobs), runtime.used_at


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
