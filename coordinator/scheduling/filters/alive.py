"""Alive: a heartbeat within `stale_after` seconds (monotonic, as `last_seen`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import BOTH, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class Alive:
    stale_after: float
    reason: str = reasons.NO_WORKERS

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return now - worker.last_seen < self.stale_after


PLUGIN = Plugin("alive", lambda options: Alive(options.stale_after), kinds=BOTH, order=10)
