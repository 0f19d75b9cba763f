"""Prefix: the share of the request's prompt the worker was not sent before (coordinator/affinity/prefixes.py
computes, per worker, how much of the prompt's prefix it was sent; the request carries that in)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class Prefix:
    name: str = "prefix"
    affinity: bool = True  # a preference, which the policy drops for a worker far busier than the least busy

    def score(self, request: Request, worker: WorkerView) -> float:
        return 1.0 - request.prefix_match.get(worker.worker_id, 0.0)


PLUGIN = Plugin("prefix", lambda options: Prefix())
