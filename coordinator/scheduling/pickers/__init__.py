"""Pickers: the last stage of a policy, ordering the workers that passed every filter.

A picker is `rank(request, workers, scores, now) -> workers best first`; `scores` are the weighted
scorers' totals (lower is better), which only the `score` picker uses. Each named routing policy
(`--routing-policy`) is one picker in its own module, which registers it by name (`PLUGIN`, see
scheduling/plugin.py); adding one is adding its module and its test. Pickers are pure: state they need (a turn counter, a random source, counts,
latencies) comes in on the request or the worker views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from coordinator.scheduling.view import Request, WorkerView


class Picker(Protocol):
    @property
    def name(self) -> str: ...

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]: ...
