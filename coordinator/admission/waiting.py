"""The waiting room: what a generation request waits for, and in which line of the queue.

Owns: the line a request waits in (the served model it means, else the offered model it names, else the
name itself), which refusals it waits out there (capacity short for now; and, for want of a worker, a
load or a swap of its model under way: a worker's `model_swapping`, this coordinator's ask, or the
heartbeats), and the step that has its model loaded (pool/loads.py asks a worker and answers 503
`loading` until one serves it). The wait itself is the queue's (turn.py, queue.py): its bound,
deadline, class and fair order, woken by releases and heartbeats. Nothing here waits or polls.
Must not: admit or place anything, or keep state of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.admission.turn import queueable
from coordinator.errors import CoordinatorError
from coordinator.pool.loads import ModelLoads, serving
from coordinator.pool.models import resolve_model
from coordinator.pool.registry import Registry
from protocol import reasons

# Refusals for want of a worker that a model's load or swap under way explains: the request waits them out.
POOL_CHANGING = frozenset({reasons.LOADING, reasons.MODEL_SWAPPING, reasons.DRAINING, reasons.NO_WORKERS,
                           reasons.MODEL_UNAVAILABLE, reasons.UNKNOWN_MODEL})


class WaitingRoom:
    def __init__(self, registry: Registry, loads: ModelLoads, *, default_model: str | None, any_model_name: bool,
                 model_loads: bool) -> None:
        self._registry, self._loads = registry, loads
        self._default, self._any_name, self._model_loads = default_model, any_model_name, model_loads

    def line(self, requested: str | None) -> str | None:
        """The model whose line of the queue a request naming `requested` waits in; None: no model is
        known yet (admission answers `no_workers`)."""
        try:
            model = resolve_model(self._registry, self._default, requested, any_name=self._any_name)
        except CoordinatorError:
            model = None
        if model is None and requested is not None:
            return self._registry.offered_as(requested) or requested
        return model

    def waits(self, line: str) -> Callable[[CoordinatorError], bool]:
        """Which refusals a request in `line` waits out."""
        registry, loads = self._registry, self._loads

        def waits(exc: CoordinatorError) -> bool:
            if queueable(exc):
                return True
            return exc.reason in POOL_CHANGING and (exc.reason == reasons.MODEL_SWAPPING or loads.loading(line)
                                                    or registry.swap_involves(line))
        return waits

    async def loaded(self, requested: str | None) -> None:
        """Returns when the model `requested` means is served, or is none a worker offers; for one a worker
        offers from its folder but none serves, one worker is asked to load it, and until it serves it
        this raises 503 `loading` (which the request waits out in its line)."""
        if requested is None:  # the model it would get: the default, or the only one (standby workers' too)
            requested = resolve_model(self._registry, self._default, None)
        if requested is None or not self._model_loads:
            return
        named = self._registry.resolve(requested)  # O(1): a served model's name or alias ends it here
        if named is not None and serving(self._registry, named):
            return
        offered = self._registry.offered_as(requested)  # the workers' offers, only for a model none serves
        if offered is not None and named in (None, offered):
            await self._loads.wanted(offered)
