"""Session room: a new conversation needs a free sequence slot (a continued one already holds its own),
and a request of several choices one per choice, all on the same worker. A slot held by an idle kept
session counts as free: the worker evicts it for a new request. So does, for an interactive request, a
batch request the worker can park (`WorkerView.preemptible`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class SessionRoom:
    reason: str = reasons.SESSIONS_FULL

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        need = request.demand.sessions
        return (need == 0 or worker.sessions - worker.idle_sessions + need <= worker.max_sessions
                or (request.demand.preempts and worker.preemptible >= need))


PLUGIN = Plugin("session_room", lambda options: SessionRoom(), order=50)
