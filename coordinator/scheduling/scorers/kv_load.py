"""KV load: the share of the worker's KV cache reserved (by its own report plus in-flight reservations)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class KvLoad:
    name: str = "kv_load"

    def score(self, request: Request, worker: WorkerView) -> float:
        return min(1.0, worker.kv_reserved_bytes / worker.kv_capacity_bytes)


PLUGIN = Plugin("kv_load", lambda options: KvLoad())
