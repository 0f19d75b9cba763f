"""Embedding room: the worker holds fewer of this coordinator's embedding requests than its embedder
takes at once (its bounded queue); another coordinator's are the worker's to refuse (503, tried on
the next worker)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import EMBEDDINGS, Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class EmbeddingRoom:
    reason: str = reasons.EMBEDDINGS_FULL

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        return worker.embedding_requests < worker.embedding_capacity


PLUGIN = Plugin("embedding_room", lambda options: EmbeddingRoom(), kinds=frozenset({EMBEDDINGS}), order=50)
