"""Embedding load: the share of the worker's embedding queue this coordinator's requests take."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import EMBEDDINGS, Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class EmbeddingLoad:
    name: str = "embedding_load"

    def score(self, request: Request, worker: WorkerView) -> float:
        return min(1.0, worker.embedding_requests / worker.embedding_capacity) if worker.embedding_capacity else 1.0


PLUGIN = Plugin("embedding_load", lambda options: EmbeddingLoad(), kinds=frozenset({EMBEDDINGS}))
