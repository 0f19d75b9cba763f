"""Session load: the share of the worker's sequence slots in use."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import BOTH, Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class SessionLoad:
    name: str = "session_load"

    def score(self, request: Request, worker: WorkerView) -> float:
        return min(1.0, worker.sessions / worker.max_sessions)


PLUGIN = Plugin("session_load", lambda options: SessionLoad(), kinds=BOTH)
