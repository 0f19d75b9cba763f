"""A slot a worker serves a model in (`WORKER_MAX_MODELS`, issue 37): what it holds, in which state.

Owns: `Slot`: its settings (which name its worker id, URL and the file it serves), its runtime, or the
closed runtime that beats `standby` while the worker holds no model, and its `Lifecycle`
(states.py); what it holds changes only with its state, through its own methods. And the worker's
slots made empty (`make_slots`: slot 0 loading the worker's first model), and two questions about
them (`beating`, `others_serve`).
Must not: decide what is loaded where (swapper.py), or know HTTP (worker/api/slots.py routes a
request to its slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.runtime import WorkerRuntime
from worker.settings import WorkerSettings
from worker.slots.states import BUSY, Lifecycle, State


@dataclass(eq=False)
class Slot:
    index: int
    settings: WorkerSettings  # its worker id and URL, and the model file it serves (or served last)
    runtime: WorkerRuntime | None = None  # the model it serves; None: none (still loading, or empty)
    standby: WorkerRuntime | None = None  # its model unloaded past the keep-alive: the closed runtime that beats
    life: Lifecycle = field(default_factory=Lifecycle)
    # The model the job on it brings in (from LOADING or SWAPPING until the job ends), or the one a changed
    # file takes away (UNLOADING, DRAINING); "" between jobs.
    target: str = ""

    @property
    def model(self) -> str:
        """The model it serves, or ""."""
        return self.runtime.names.name if self.runtime is not None else ""

    @property
    def state(self) -> State:
        return self.life.state

    @property
    def busy(self) -> bool:
        """A load, swap, unload or drain runs in it."""
        return self.life.state in BUSY

    async def reached(self, state: State, timeout: float) -> None:
        """Returns once the slot is in `state`; `TimeoutError` after `timeout` seconds."""
        await self.life.reached(state, timeout)

    def loading(self, model: str) -> None:
        """A model is built into it: from EMPTY or STANDBY (the standby beats on until `served`)."""
        self.life.to(State.LOADING)
        self.target = model

    def swapping(self, model: str) -> None:
        """Its model drains, to be closed and `model` loaded in its place."""
        self.life.to(State.SWAPPING)
        self.target = model

    def unloading(self, model: str = "") -> None:
        """Its model drains, to be closed (`model`: the one whose file changed; "": idle, or making room)."""
        self.life.to(State.UNLOADING)
        self.target = model

    def draining(self, model: str) -> None:
        """Its model, whose file is gone with no other offered, drains; then the worker stops."""
        self.life.to(State.DRAINING)
        self.target = model

    def closed(self) -> None:
        """A swap's model drained: the slot serves none while the next loads."""
        assert self.life.state is State.SWAPPING
        self.runtime = None

    def served(self, runtime: WorkerRuntime, settings: WorkerSettings) -> None:
        """`runtime` serves in it now (a load or swap ended), with `settings`; a standby before it is gone."""
        self.settings, self.runtime, self.standby = settings, runtime, None
        self.life.to(State.SERVING)

    def stood_by(self, runtime: WorkerRuntime) -> None:
        """Its model unloaded, the last one served: `runtime`, closed, beats on saying `standby`; or a load
        from standby failed, and it stays so."""
        self.runtime, self.standby = None, runtime
        self.life.to(State.STANDBY)

    def emptied(self) -> WorkerRuntime | None:
        """It holds no model now (an unload beside others served, a failed load or swap, a file gone, the
        worker's close); returns the standby it held, if any, for its last beat."""
        standby, self.runtime, self.standby = self.standby, None, None
        if self.life.state is not State.EMPTY:
            self.life.to(State.EMPTY)
        return standby

    def settle(self) -> None:
        """After a load, swap or unload that raised: the state says what the slot holds now (SERVING with a
        runtime, STANDBY with a standby, else EMPTY), so no slot stays busy with nothing running."""
        held = State.SERVING if self.runtime is not None else State.STANDBY if self.standby is not None else None
        if held is None:
            self.emptied()
        elif self.life.state is not held:
            self.life.to(held)


    def job_ended(self) -> None:
        """The job on it ended (its memory given back): a next ask for its model is a job of its own."""
        self.target = ""


def make_slots(settings: WorkerSettings) -> list[Slot]:
    """The worker's `max_models` slots, empty: slot 0 with the worker's own settings, loading its first model."""
    slots = [Slot(k, settings.for_slot(k)) for k in range(settings.max_models)]
    slots[0].loading("")
    return slots


def beating(slots: Sequence[Slot]) -> bool:
    """Some slot serves a model or beats in standby: the worker is up (not still loading its first model,
    nor left with none)."""
    return any(s.runtime is not None or s.standby is not None for s in slots)


def others_serve(slots: Sequence[Slot], slot: Slot) -> bool:
    """A slot other than `slot` serves a model."""
    return any(s.runtime is not None for s in slots if s is not slot)
