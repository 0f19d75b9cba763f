"""Breaker closed: a worker whose requests kept failing sits out its cool-down (coordinator/pool/breaker.py);
once the cool-down has passed, one probe request may go while no other probe is in flight."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import BOTH, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class BreakerClosed:
    reason: str = reasons.WORKER_UNAVAILABLE

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return worker.breaker_open_until <= now and not worker.breaker_probing


PLUGIN = Plugin("breaker_closed", lambda options: BreakerClosed(), kinds=BOTH, order=40)
