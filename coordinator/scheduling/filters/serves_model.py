"""Serves the model: the worker's model is the one asked for (any, when none was)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import BOTH, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class ServesModel:
    reason: str = reasons.MODEL_UNAVAILABLE

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return request.model is None or worker.model == request.model


PLUGIN = Plugin("serves_model", lambda options: ServesModel(), kinds=BOTH, order=20)
