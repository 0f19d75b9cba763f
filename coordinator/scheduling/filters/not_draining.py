"""Not draining: a worker shutting down takes no new request."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import BOTH, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class NotDraining:
    reason: str = reasons.DRAINING

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return not worker.draining


PLUGIN = Plugin("not_draining", lambda options: NotDraining(), kinds=BOTH, order=30)
