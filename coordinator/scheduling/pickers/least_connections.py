"""least-connections: the fewest streams the coordinator itself has in flight on the worker (its own
count, current to the request, unlike a heartbeat); ties to the lower worker id."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class LeastConnections:
    name: str = "least-connections"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        return sorted(workers, key=lambda w: (w.in_flight, w.worker_id))


PLUGIN = Plugin("least-connections", lambda options: LeastConnections())
