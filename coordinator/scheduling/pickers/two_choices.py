"""two-choices: the power of two random choices. Two eligible workers are drawn from the request's seeded
random source, and the one with fewer streams in flight from this coordinator goes first (ties: the
lower weighted score, then the lower id); the other follows, then every other worker by the same rule,
for failover.

Why: least-connections sends a burst to the one least loaded worker, and with several coordinators
each sends its burst to the same one, since each sees only its own count. A draw of two spreads the
burst, and the better of two random picks keeps the most loaded worker's load within a small factor of
the average (Mitzenmacher's result, which load balancers such as Envoy's and nginx's `random two`
build on). With fewer than three workers it is least-connections.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class TwoChoices:
    name: str = "two-choices"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        def load(worker: WorkerView) -> tuple[int, float, str]:
            return worker.in_flight, scores.get(worker.worker_id, 0.0), worker.worker_id

        ordered = sorted(workers, key=lambda w: w.worker_id)  # the draw alone decides, not input order
        if len(ordered) <= 2 or request.rng is None:
            return sorted(ordered, key=load)
        drawn = request.rng.sample(ordered, 2)
        rest = sorted((w for w in ordered if w not in drawn), key=load)
        return sorted(drawn, key=load) + rest


PLUGIN = Plugin("two-choices", lambda options: TwoChoices())
