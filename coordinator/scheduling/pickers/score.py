"""score: the lowest weighted total of the policy's scorers first (ties to the lower worker id)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class ByScore:
    name: str = "score"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        return sorted(workers, key=lambda w: (scores[w.worker_id], w.worker_id))
