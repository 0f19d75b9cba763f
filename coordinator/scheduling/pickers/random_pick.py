"""random: a uniform shuffle of the eligible workers, drawn from the random source the request
carries (seeded by the coordinator's `--routing-seed`, so a run can be reproduced)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class RandomPick:
    name: str = "random"

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        ordered = sorted(workers, key=lambda w: w.worker_id)  # the draw alone decides, not input order
        if request.rng is None:
            return ordered
        request.rng.shuffle(ordered)
        return ordered


PLUGIN = Plugin("random", lambda options: RandomPick())
