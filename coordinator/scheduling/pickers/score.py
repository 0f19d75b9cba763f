"""score: the lowest weighted total of the policy's scorers first; ties to the worker picked least
recently, then to the lower id. Not to the id alone: idle workers that never answer (a fake with the
worker token) would otherwise win every tie their ids sort first in, and be tried first each time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class ByScore:
    name: str = "score"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        return sorted(workers, key=lambda w: (scores[w.worker_id], w.picked_at, w.worker_id))


PLUGIN = Plugin("score", lambda options: ByScore())
