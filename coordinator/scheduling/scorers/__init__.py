"""Scorers: each rates a worker for a request in [0, 1], lower is better (a cost), with no I/O.

The policy weighs them (weights from settings, outside the scorers) and sums. Each module registers its
scorer by name (`PLUGIN`, see scheduling/plugin.py); adding one is adding its module and its test.
"""

from __future__ import annotations

from typing import Protocol

from coordinator.scheduling.view import Request, WorkerView


class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(self, request: Request, worker: WorkerView) -> float: ...
