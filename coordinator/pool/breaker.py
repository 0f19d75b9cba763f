"""Circuit breakers: a worker whose requests keep failing sits out a cool-down that grows each time.

Owns: counting consecutive failures per worker, opening its breaker after `threshold` of them for
`cooldown x 2^(trips - 1)` seconds (at most `max_cooldown`), letting one probe request through once
the cool-down has passed, and closing on that probe's success (or reopening, longer, on its failure).
Must not: pick workers (the scheduler's `breaker_closed` filter reads the state this module writes on
the registry's records) or judge a refusal: a 503 for capacity or a 4xx is the worker working.

What fails: the worker cannot be reached, answers 5xx other than 503, breaks or ends its stream before
`done`, or ends it with `worker_failed` / `engine_failed`. What is no verdict: the client leaving or
reading too slowly, a capacity refusal; a probe that ends that way frees its probe slot only. A
refused connection is more than a failure: the worker is gone (`gone`).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.pool.registry import Registry, WorkerRecord


class Breakers:
    def __init__(self, registry: Registry, clock: Callable[[], float], *, threshold: int, cooldown: float,
                 max_cooldown: float, on_change: Callable[[str], None] | None = None) -> None:
        self._registry = registry
        self._now = clock
        self.threshold = threshold
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self._on_change = on_change or (lambda state: None)  # "open" or "closed", for the metrics

    def attempt(self, worker: WorkerRecord) -> None:
        """A request is about to go to `worker`: if its breaker was open and has cooled down, this
        request is the probe, and no other goes until it ends."""
        if worker.breaker_trips and worker.breaker_open_until <= self._now():
            worker.breaker_probing = True

    def succeeded(self, worker_id: str) -> None:
        worker = self._registry.get(worker_id)
        if worker is None:
            return
        if worker.breaker_trips:
            self._on_change("closed")
        worker.breaker_failures = worker.breaker_trips = 0
        worker.breaker_open_until, worker.breaker_probing = 0.0, False

    def failed(self, worker_id: str) -> None:
        worker = self._registry.get(worker_id)
        if worker is None:
            return
        worker.breaker_failures += 1
        if worker.breaker_probing or worker.breaker_failures >= self.threshold:
            worker.breaker_trips += 1
            cool = min(self.max_cooldown, self.cooldown * 2 ** (worker.breaker_trips - 1))
            worker.breaker_open_until, worker.breaker_probing = self._now() + cool, False
            worker.breaker_failures = 0
            self._on_change("open")

    def gone(self, worker_id: str) -> None:
        """Nothing listens at the worker's address any more (a refused connection): no cool-down to
        count, it leaves the pool now (`Registry.lost`) and is back with its next heartbeat."""
        self._registry.lost(worker_id, self._now())

    def settled(self, worker_id: str) -> None:
        """The request ended with no verdict on the worker: a probe slot it held is free again."""
        worker = self._registry.get(worker_id)
        if worker is not None:
            worker.breaker_probing = False
