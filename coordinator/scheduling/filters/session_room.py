"""Session room: a new conversation needs a free sequence slot (a continued one already holds its own).
A slot held by an idle kept session counts as free: the worker evicts it for a new request."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class SessionRoom:
    reason: str = reasons.SESSIONS_FULL

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return not request.demand.new_session or worker.sessions - worker.idle_sessions < worker.max_sessions
