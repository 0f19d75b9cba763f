"""round-robin: the eligible workers in id order, starting one further along for each request
(`Request.turn`, a counter the coordinator advances); the rest follow as failover order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class RoundRobin:
    name: str = "round-robin"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        start = request.turn % len(ordered)
        return ordered[start:] + ordered[:start]


PLUGIN = Plugin("round-robin", lambda options: RoundRobin())
