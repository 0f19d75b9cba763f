"""worker/slots/swapper.py's Swapper, with a runtime and a build of its own: one swap at a time, the order
(drain, stop, then load), a model that fails to load refused for a while with its reason while the
model served before comes back, and what cannot be swapped to; the keep-alive's unload of an idle
model (standby) and the load that ends it."""

from __future__ import annotations

import asyncio
import gc
import weakref
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from protocol.worker import MODEL_LOAD_BACKOFF
from worker.errors import WorkerError
from worker.metrics import WorkerMetrics
from worker.models.catalog import Offer
from worker.naming import ModelNames
from worker.settings import WorkerSettings
from worker.slots.slot import make_slots
from worker.slots.states import State
from worker.slots.swapper import Swapper, give_back_freed_memory

pytestmark = pytest.mark.anyio
OFFERS = [Offer(Path("/m/a.gguf"), "offered", ModelNames("small", ("a",)), identity="gguf:a"),
          Offer(Path("/m/b.gguf"), "offered", ModelNames("gemma", ("b",)), identity="gguf:b"),
          Offer(Path("/m/c.gguf"), "too_large", ModelNames("big", ("c",)), reason="needs 9 bytes; the budget is 8")]

NAMES = {"a.gguf": "small", "b.gguf": "gemma", "d.gguf": "third"}
THIRD = Offer(Path("/m/d.gguf"), "offered", ModelNames("third", ("d",)), identity="gguf:d")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the worker runs on uvicorn's asyncio loop


class Runtime:
    def __init__(self, name: str, steps: list[str], metrics: WorkerMetrics) -> None:
        self.names, self.jobs, self.metrics, self._steps = ModelNames(name), [], metrics, steps
        self.model = SimpleNamespace(identity={"small": "gguf:a", "gemma": "gguf:b", "third": "gguf:d"}[name])
        self.offers: list[Offer] = []
        self.heartbeats = SimpleNamespace(swapping="", standby=False, offered=[], send_once=self._beat)
        self.gate = SimpleNamespace(swapping="")
        self.idle = 0.0  # what idle_for says: seconds with no request and no kept session
        self.keep_alive: float | None = 0.2
        self.used_at = 0.0

    def idle_for(self) -> float:
        return self.idle

    def offer(self, offers: list[Offer], beside: Any = ()) -> None:
        self.offers, self.beside = offers, set(beside)
        if self.heartbeats.standby:  # as WorkerRuntime.offer: listed with none loaded
            self.heartbeats.offered = list(offers)

    def stand_by(self, offers: list[Offer]) -> None:
        self.heartbeats.standby = True
        self.offer(offers)

    def swapping_to(self, model: str) -> None:
        self.gate.swapping = self.heartbeats.swapping = model

    async def drain(self, timeout: float) -> None:
        self._steps.append(f"drain {self.names.name} {timeout:g}")

    async def stop(self, *, leaving: bool = True) -> None:
        self._steps.append(f"stop {self.names.name}" + ("" if leaving else " beating"))

    async def _beat(self, *, leaving: bool = False) -> bool:
        self._steps.append(f"beat {self.names.name}" + (" leaving" if leaving else ""))
        return True

    async def end_beats(self) -> None:
        self._steps.append(f"beats end {self.names.name}")


def swapper(fails: set[str], clock: list[float], lost: list[str] | None = None,
            give_back: Any = lambda: None, offers: list[Offer] = OFFERS,
            **more: Any) -> tuple[Swapper, Any, list[str]]:
    """`more`: settings of the worker (`max_models`, `model_memory`)."""
    steps: list[str] = []
    metrics = WorkerMetrics()
    settings = WorkerSettings(model_path=Path("/m/a.gguf"), model_dir=Path("/m"), port=8000, **more)
    slots = make_slots(settings)
    slots[0].served(Runtime("small", steps, metrics), settings)  # type: ignore[arg-type]
    app = SimpleNamespace(state=SimpleNamespace(settings=settings, slots=slots, metrics=metrics))

    async def build(wanted: WorkerSettings) -> Any:
        await asyncio.sleep(0)
        steps.append(f"load {wanted.model_path.name}")
        if wanted.model_path.name in fails:
            raise RuntimeError("the tensors do not fit")
        return Runtime(NAMES[wanted.model_path.name], steps, metrics)

    on_lost = lost.append if lost is not None else (lambda why: None)
    swap = Swapper(slots, settings, metrics, offers, build, clock=lambda: clock[0], on_lost=on_lost,
                   give_back=give_back)
    return swap, app, steps


async def test_a_swap_drains_stops_then_loads_and_a_second_ask_joins_it() -> None:
    swap, app, steps = swapper(set(), [0.0])
    assert swap.load("small").state == "loaded"
    assert swap.load("b").model_dump() == {"model": "gemma", "state": "loading"}
    assert swap.load("gemma").state == "loading"  # the same swap
    with pytest.raises(WorkerError) as busy:
        swap.load("small")
    assert (busy.value.status, busy.value.reason) == (503, "model_swapping")
    old = app.state.slots[0].runtime
    await swap._task  # type: ignore[misc]
    assert old.heartbeats.swapping == old.gate.swapping == "gemma"  # its beats and refusals said where it went
    # The old model's heartbeats go on while the next loads, and end once it is loaded.
    assert steps == ["drain small 600", "stop small beating", "load b.gguf", "beats end small"]
    assert app.state.slots[0].runtime.names.name == "gemma" and app.state.slots[0].settings.model_path == Path("/m/b.gguf")
    assert swap.load("gemma").state == "loaded" and swap.swapping == ""


async def test_a_model_that_fails_to_load_brings_back_the_one_before_and_is_refused_for_a_while() -> None:
    clock = [0.0]
    swap, app, steps = swapper({"b.gguf"}, clock)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert steps[-3:] == ["load b.gguf", "load a.gguf", "beats end small"]
    assert app.state.slots[0].runtime.names.name == "small"
    with pytest.raises(WorkerError) as refused:
        swap.load("gemma")
    assert (refused.value.status, refused.value.reason) == (503, "model_load_failed")
    assert "the tensors do not fit" in refused.value.message
    clock[0] = MODEL_LOAD_BACKOFF
    assert swap.load("gemma").state == "loading"  # tried again after the pause
    await swap._task  # type: ignore[misc]


async def test_a_swap_that_leaves_no_model_stops_the_worker() -> None:
    lost: list[str] = []
    swap, app, steps = swapper({"a.gguf", "b.gguf"}, [0.0], lost)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert steps[-3:] == ["load b.gguf", "load a.gguf", "beats end small"] and app.state.slots[0].runtime is None
    assert len(lost) == 1 and "left no model loaded" in lost[0]
    assert app.state.slots[0].state is State.EMPTY  # settled: not left swapping


@pytest.mark.parametrize(("name", "status", "reason"), [("nowhere", 404, "unknown_model"),
                                                         ("big", 400, "invalid_request")])
async def test_what_the_folder_does_not_offer_is_refused_with_why(name: str, status: int, reason: str) -> None:
    swap, _, steps = swapper(set(), [0.0])
    with pytest.raises(WorkerError) as refused:
        swap.load(name)
    assert (refused.value.status, refused.value.reason) == (status, reason) and steps == []
    if name == "big":
        assert "needs 9 bytes" in refused.value.message


async def test_an_unchanged_folder_swaps_nothing_and_a_new_file_is_listed() -> None:
    swap, app, steps = swapper(set(), [0.0])
    more = [*OFFERS, Offer(Path("/m/d.gguf"), "offered", ModelNames("new", ("d",)), identity="gguf:d")]
    swap.refresh(more)
    assert swap.swapping == "" and steps == [] and app.state.slots[0].runtime.offers == more
    assert swap.load("new").state == "loading"  # the new file can be asked for
    await swap._task  # type: ignore[misc]


async def test_a_served_file_replaced_on_disk_is_loaded_again_after_its_streams() -> None:
    swap, app, steps = swapper(set(), [0.0])
    replaced = [replace(OFFERS[0], identity="gguf:a2"), *OFFERS[1:]]
    swap.refresh(replaced)
    assert swap.swapping == "small"
    await swap._task  # type: ignore[misc]
    # The file there now, not the old mapping.
    assert steps == ["drain small 600", "stop small beating", "load a.gguf", "beats end small"]
    assert app.state.slots[0].runtime.offers == replaced


async def test_a_served_file_removed_swaps_to_the_first_model_offered() -> None:
    swap, app, steps = swapper(set(), [0.0])
    swap.refresh(OFFERS[1:])
    await swap._task  # type: ignore[misc]
    assert steps == ["drain small 600", "stop small beating", "load b.gguf", "beats end small"]
    assert app.state.slots[0].runtime.names.name == "gemma"


async def test_a_served_file_removed_with_no_other_model_drains_then_stops_the_worker() -> None:
    lost: list[str] = []
    swap, app, steps = swapper(set(), [0.0], lost)
    swap.refresh([OFFERS[2]])  # only a file too large to load
    assert app.state.slots[0].state is State.DRAINING
    await swap._task  # type: ignore[misc]
    assert steps == ["drain small 600", "stop small"] and app.state.slots[0].runtime is None
    assert len(lost) == 1 and "is gone" in lost[0] and app.state.slots[0].state is State.EMPTY


async def test_a_model_outside_the_folder_is_not_watched() -> None:
    swap, app, steps = swapper(set(), [0.0])
    app.state.slots[0].settings = WorkerSettings(model_path=Path("/elsewhere/a.gguf"), model_dir=Path("/m"))
    swap.refresh([])
    assert swap.swapping == "" and steps == []


async def test_the_watch_reads_the_folder_again_and_survives_a_failed_read() -> None:
    swap, app, _ = swapper(set(), [0.0])
    reads: list[int] = []

    def read() -> list[Offer]:
        reads.append(1)
        if len(reads) == 1:
            raise OSError("the disk is gone")
        return OFFERS[1:]

    swap.watch(read, 0.01)
    for _ in range(200):
        if swap.swapping or app.state.slots[0].runtime.names.name == "gemma":
            break
        await asyncio.sleep(0.01)
    assert len(reads) >= 2 and app.state.metrics.internal_errors.labels(task="folder_watch")._value.get() == 1
    await swap.close()


async def test_a_model_idle_past_the_keep_alive_is_unloaded_and_a_load_ends_the_standby() -> None:
    swap, app, steps = swapper(set(), [0.0])
    old = app.state.slots[0].runtime
    swap.keep_alive(0.05)
    await asyncio.sleep(0.3)
    assert steps == [] and swap.standby == ""  # busy (idle_for 0): kept however long
    old.idle, old.keep_alive = 0.25, None
    await asyncio.sleep(0.3)
    assert steps == [] and swap.standby == ""  # a request's keep_alive -1: kept for good
    old.keep_alive = 0.2
    await app.state.slots[0].reached(State.STANDBY, timeout=2.0)
    assert swap.standby == "small"
    await swap._task  # type: ignore[misc]
    # Drained and closed as for a swap; its beats go on, saying standby, with nothing loaded.
    assert steps == ["drain small 600", "stop small beating"] and app.state.slots[0].runtime is None
    assert old.heartbeats.standby and [o.state for o in old.heartbeats.offered] == ["offered", "offered", "too_large"]
    assert app.state.metrics.model_swaps.labels("unloaded")._value.get() == 1
    swap.refresh(OFFERS[:2])  # the folder read again: the standby's beats list it
    assert len(old.heartbeats.offered) == 2
    assert swap.load("gemma").model_dump() == {"model": "gemma", "state": "loading"}
    assert swap.load("b").state == "loading"  # the same load
    await swap._task  # type: ignore[misc]
    assert steps[2:] == ["load b.gguf", "beats end small"] and swap.standby == ""
    assert app.state.slots[0].runtime.names.name == "gemma" and app.state.slots[0].settings.model_path == Path("/m/b.gguf")
    await swap.close()


async def test_a_load_that_fails_from_standby_stays_in_standby_and_is_refused_for_a_while() -> None:
    clock = [0.0]
    swap, app, steps = swapper({"b.gguf"}, clock)
    app.state.slots[0].runtime.idle = 1.0
    swap.keep_alive(0.01)
    await app.state.slots[0].reached(State.STANDBY, timeout=2.0)
    assert swap.standby == "small"
    await swap._task  # type: ignore[misc]
    with pytest.raises(WorkerError) as unloading:
        swap._task = asyncio.create_task(asyncio.sleep(0.05))  # while an unload (or load) runs
        swap.load("gemma")
    assert (unloading.value.status, unloading.value.reason) == (503, "model_swapping")
    await swap._task
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert steps[-1] == "load b.gguf" and app.state.slots[0].runtime is None and swap.standby == "small"
    with pytest.raises(WorkerError) as refused:
        swap.load("gemma")
    assert (refused.value.status, refused.value.reason) == (503, "model_load_failed")
    assert swap.load("small").state == "loading"  # another model loads
    await swap._task  # type: ignore[misc]
    assert app.state.slots[0].runtime.names.name == "small" and steps[-2:] == ["load a.gguf", "beats end small"]
    await swap.close()


async def test_the_runtime_before_is_given_back_once_the_swap_ends_whatever_cycles_hold_it() -> None:
    """The closed runtime's objects hold each other in cycles, which only the cyclic collector frees; with it
    switched off here, only the swap's own collection can."""
    swap, app, _ = swapper(set(), [0.0], give_back=give_back_freed_memory)
    old = app.state.slots[0].runtime
    old.cycle = old  # as the real runtime's callbacks make one
    gone = weakref.ref(old)
    del old
    gc.disable()
    try:
        swap.load("gemma")
        await swap._task  # type: ignore[misc]
        assert gone() is None
    finally:
        gc.enable()


# --- several models at once (WORKER_MAX_MODELS): each in a slot of its own -------------------------------


async def test_with_two_slots_a_second_model_loads_beside_the_first_and_nothing_drains() -> None:
    swap, app, steps = swapper(set(), [0.0], max_models=2)
    first, second = app.state.slots
    assert first.runtime.beside == {Path("/m/b.gguf")}  # its beats say gemma would load beside it
    assert swap.load("gemma").state == "loading"
    await swap._task  # type: ignore[misc]
    assert steps == ["load b.gguf"]  # the model served goes on: no drain, no stop
    assert first.runtime.names.name == "small" and second.runtime.names.name == "gemma"
    assert (second.settings.worker_id, second.settings.worker_url) == ("worker-8000.m1",
                                                                       "http://127.0.0.1:8000/slots/1")
    assert second.settings.model_path == Path("/m/b.gguf") and second.runtime.offers == OFFERS
    assert swap.load("b").state == swap.load("small").state == "loaded"
    assert app.state.metrics.model_swaps.labels("added")._value.get() == 1
    assert first.runtime.beside == second.runtime.beside == set()  # no slot free: a third would swap


async def test_with_every_slot_taken_the_least_wanted_model_is_swapped() -> None:
    swap, app, steps = swapper(set(), [0.0], offers=[*OFFERS, THIRD], max_models=2)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    first, second = app.state.slots
    first.runtime.idle, second.runtime.idle = 0.0, 5.0  # small has a stream; gemma is idle
    swap.load("third")
    await swap._task  # type: ignore[misc]
    assert steps[1:] == ["drain gemma 600", "stop gemma beating", "load d.gguf", "beats end gemma"]
    assert first.runtime.names.name == "small" and second.runtime.names.name == "third"
    first.runtime.idle, second.runtime.idle = 3.0, 0.0  # now small is the idle one
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert first.runtime.names.name == "gemma" and second.runtime.names.name == "third"


async def test_past_the_memory_budget_a_model_is_swapped_not_added() -> None:
    sized = [replace(o, weight_bytes=600) for o in OFFERS[:2]]
    swap, app, steps = swapper(set(), [0.0], offers=sized, max_models=2, model_memory=1000)
    assert app.state.slots[0].runtime.beside == set()  # gemma would not fit beside small
    swap.load("gemma")  # 600 + 600 > 1000: small makes room, though a slot is free
    await swap._task  # type: ignore[misc]
    assert steps == ["drain small 600", "stop small beating", "load b.gguf", "beats end small"]
    assert [s.model for s in app.state.slots] == ["gemma", ""]


async def test_making_room_unloads_more_than_one_model_when_one_is_not_enough() -> None:
    sized = [replace(OFFERS[0], weight_bytes=300), replace(OFFERS[1], weight_bytes=300),
             replace(THIRD, weight_bytes=900)]
    swap, app, steps = swapper(set(), [0.0], offers=sized, max_models=3, model_memory=1000)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    swap.load("third")  # 900: both others go; the one swapped keeps its slot, the other leaves
    await swap._task  # type: ignore[misc]
    assert {"stop small beating", "stop gemma", "load d.gguf", "beats end small"} <= set(steps)
    assert [s.model for s in app.state.slots] == ["third", "", ""]
    assert app.state.slots[1].standby is None  # emptied, not standby: another model is served


async def test_with_two_slots_an_idle_model_leaves_and_the_last_one_stays_in_standby() -> None:
    swap, app, steps = swapper(set(), [0.0], max_models=2)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    first, second = app.state.slots
    second.runtime.idle, first.runtime.keep_alive = 1.0, None
    swap.keep_alive(0.01)
    await second.reached(State.EMPTY, timeout=2.0)
    assert second.runtime is None
    await swap._task  # type: ignore[misc]
    assert steps[1:] == ["drain gemma 600", "stop gemma"]  # its last beat says it leaves
    assert second.standby is None and swap.standby == "" and first.runtime.names.name == "small"
    first.runtime.idle, first.runtime.keep_alive = 1.0, 0.2
    await first.reached(State.STANDBY, timeout=2.0)
    assert swap.standby == "small"
    await swap._task  # type: ignore[misc]
    assert steps[3:] == ["drain small 600", "stop small beating"] and first.standby is not None
    swap.load("gemma")  # from standby: into the standby's slot
    await swap._task  # type: ignore[misc]
    assert [s.model for s in app.state.slots] == ["gemma", ""]
    await swap.close()


async def test_a_failed_swap_in_one_of_several_slots_empties_it_and_says_so() -> None:
    lost: list[str] = []
    swap, app, steps = swapper({"a.gguf", "d.gguf"}, [0.0], lost, offers=[*OFFERS, THIRD], max_models=2)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    app.state.slots[1].runtime.idle = 0.0  # gemma busy: small (idle) is swapped
    app.state.slots[0].runtime.idle = 2.0
    swap.load("third")
    await swap._task  # type: ignore[misc]
    # Neither third nor small could be loaded: the slot's beats say it leaves; gemma goes on serving.
    assert steps[-4:] == ["load d.gguf", "load a.gguf", "beat small leaving", "beats end small"]
    assert [s.model for s in app.state.slots] == ["", "gemma"] and lost == []


async def test_with_two_slots_a_removed_file_empties_its_slot_and_the_other_model_goes_on() -> None:
    lost: list[str] = []
    swap, app, steps = swapper(set(), [0.0], lost, max_models=2)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    swap.refresh([OFFERS[0]])  # gemma's file is gone; small, the only model left, is served already
    await swap._task  # type: ignore[misc]
    assert steps[1:] == ["drain gemma 600", "stop gemma"]
    assert [s.model for s in app.state.slots] == ["small", ""] and lost == []


# --- supervision: nothing in it dies silently, and no slot is left busy ----------------------------------


async def test_a_keep_alive_look_that_raises_is_logged_and_counted_and_the_next_look_is_made(
        caplog: pytest.LogCaptureFixture) -> None:
    swap, app, steps = swapper(set(), [0.0])
    slot = app.state.slots[0]
    looks: list[int] = []

    def idle_for() -> float:
        looks.append(1)
        if len(looks) == 1:
            raise RuntimeError("the table is gone")
        return 1.0

    slot.runtime.idle_for = idle_for
    swap.keep_alive(0.01)
    await slot.reached(State.STANDBY, timeout=2.0)
    await swap._task  # type: ignore[misc]
    assert app.state.metrics.internal_errors.labels(task="keep_alive")._value.get() == 1
    assert "the table is gone" in caplog.text and steps == ["drain small 600", "stop small beating"]
    await swap.close()


async def broken_drain(timeout: float) -> None:
    raise RuntimeError("the engine thread died")


async def test_an_unload_that_raises_leaves_its_slot_serving_what_it_holds_not_unloading() -> None:
    lost: list[str] = []
    swap, app, _ = swapper(set(), [0.0], lost)
    slot = app.state.slots[0]

    slot.runtime.drain, slot.runtime.idle = broken_drain, 1.0
    swap.keep_alive(0.01)
    await slot.reached(State.UNLOADING, timeout=2.0)
    swap._idle_watch.cancel()  # type: ignore[union-attr]  # one unload is enough to watch
    await swap._task  # type: ignore[misc]
    assert slot.state is State.SERVING and slot.runtime.names.name == "small" and lost == []
    assert app.state.metrics.internal_errors.labels(task="swap")._value.get() == 1
    assert swap.load("gemma").state == "loading"  # nothing is stuck: the next job runs
    await swap._task  # type: ignore[misc]
    await swap.close()


async def test_a_drain_for_a_removed_file_that_raises_still_stops_the_worker_once() -> None:
    lost: list[str] = []
    swap, app, _ = swapper(set(), [0.0], lost)
    slot = app.state.slots[0]

    slot.runtime.drain = broken_drain
    swap.refresh([OFFERS[2]])
    await swap._task  # type: ignore[misc]
    assert slot.state is State.EMPTY and slot.runtime is None
    assert len(lost) == 1 and "is gone" in lost[0]
    assert app.state.metrics.internal_errors.labels(task="swap")._value.get() == 1
