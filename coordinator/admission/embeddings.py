"""Admission of embedding requests: the O(1) check before a worker is chosen, and the slot a request
holds on its worker while that worker computes it.

Owns: `check` (the registry's per-model sums only, as for generation: no loop over workers) and the
embedding slots this coordinator holds. A worker that serves embeddings offers `capacity` slots (its
embedder's bounded queue, from its heartbeat); a slot is held from the moment the worker is chosen
until its answer is read, whatever the ending, and its release wakes that model's embedding queue.
Must not: choose a worker (scheduling/) or talk to one (relay/embeddings.py). Embedding requests take
no sequence and no KV of the generation context, so generation's reservations (capacity.py) and
theirs never count against each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.clock import Clock
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Registry, WorkerRecord
from protocol import reasons


@dataclass(slots=True)
class EmbeddingSlot:
    worker_id: str
    model: str
    released: bool = False


class EmbeddingAdmission:
    def __init__(self, registry: Registry, clock: Clock, *, retry_after: int,
                 on_release: Callable[[str], None] | None = None) -> None:
        self._registry = registry
        self._clock = clock
        self._retry_after = retry_after
        self._on_release = on_release or (lambda model: None)  # a slot for that model may have freed
        self.in_flight = 0

    def check(self, model: str | None) -> None:
        """Raise a `CoordinatorError` when no alive worker can take an embedding request now. O(1)."""
        self._registry.sweep(self._clock.monotonic())
        if self._registry.alive_count == 0:
            raise CoordinatorError(reasons.NO_WORKERS, "no worker is alive", retry_after=self._retry_after)
        totals = self._registry.totals(model)
        if totals is None:
            if model is not None and self._registry.served_lately(model):
                raise CoordinatorError(reasons.MODEL_UNAVAILABLE, f"no alive worker serves {model!r} now",
                                       retry_after=self._retry_after)
            raise CoordinatorError(reasons.UNKNOWN_MODEL, f"no worker serves model {model!r}", param="model")
        if totals.embedding_workers == 0:
            raise CoordinatorError(reasons.EMBEDDINGS_UNSUPPORTED, f"no worker of {model!r} serves embeddings (a "
                                   "worker says so in its heartbeat; see WORKER_EMBEDDINGS)", param="model")
        if totals.free_embedding_slots <= 0:
            raise CoordinatorError(reasons.EMBEDDINGS_FULL, "every embedding slot of this model's workers is taken",
                                   retry_after=self._retry_after)

    def reserve(self, worker: WorkerRecord) -> EmbeddingSlot:
        self._registry.hold_embedding(worker.worker_id, +1)
        worker.in_flight += 1
        worker.picked_at = self._clock.monotonic()
        self.in_flight += 1
        return EmbeddingSlot(worker.worker_id, worker.model)

    def release(self, slot: EmbeddingSlot) -> None:
        """Idempotent; call it however the request ended."""
        if slot.released:
            return
        slot.released = True
        self.in_flight -= 1
        worker = self._registry.get(slot.worker_id)
        if worker is not None:
            worker.in_flight = max(0, worker.in_flight - 1)
        try:
            self._registry.hold_embedding(slot.worker_id, -1)
        finally:
            self._on_release(slot.model)
