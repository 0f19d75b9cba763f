"""Serves embeddings: the worker said in its heartbeat that it embeds (`Heartbeat.embeddings`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import EMBEDDINGS, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class ServesEmbeddings:
    reason: str = reasons.EMBEDDINGS_UNSUPPORTED

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return worker.embedding_capacity > 0


PLUGIN = Plugin("serves_embeddings", lambda options: ServesEmbeddings(), kinds=frozenset({EMBEDDINGS}), order=25)
