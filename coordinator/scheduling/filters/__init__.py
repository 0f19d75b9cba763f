"""Filters: each drops the workers that cannot take a request, and names the reason when none is left.

A filter is `keep(request, worker, now) -> bool` plus the `reason` a request hears when it leaves no
worker. Each module registers its filter (`PLUGIN`, see scheduling/plugin.py) with the policies that
use it and its place (`order`): filters run in that order, so the reason is the first limit that bit.
"""

from __future__ import annotations

from typing import Protocol

from coordinator.scheduling.view import Request, WorkerView


class Filter(Protocol):
    @property
    def reason(self) -> str: ...

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool: ...
