"""What the scheduler reads and returns: the worker view, the request, the decision.

Owns: the types every filter and scorer shares. Must not: hold logic.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from coordinator.admission.demand import Demand

NO_MATCH: Mapping[str, float] = MappingProxyType({})


class WorkerView(Protocol):
    """What the scheduler reads of a worker (registry.WorkerRecord satisfies it)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def last_seen(self) -> float: ...
    @property
    def sessions(self) -> int: ...
    @property
    def max_sessions(self) -> int: ...
    @property
    def idle_sessions(self) -> int: ...  # of `sessions`: kept with no stream, evictable for a new one
    @property
    def idle_kv_bytes(self) -> int: ...  # of `kv_reserved_bytes`: held by those idle sessions
    @property
    def preemptible(self) -> int: ...  # batch requests an interactive one may still park there
    @property
    def kv_reserved_bytes(self) -> int: ...
    @property
    def kv_capacity_bytes(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def session_max_tokens(self) -> int: ...
    @property
    def draining(self) -> bool: ...
    @property
    def breaker_open_until(self) -> float: ...  # monotonic seconds; 0: closed
    @property
    def breaker_probing(self) -> bool: ...  # a probe request is in flight: no other until it ends
    @property
    def in_flight(self) -> int: ...  # streams the coordinator has on it now (its own count)
    @property
    def ttft_ewma(self) -> float | None: ...  # seconds, recent time to first token; None: no sample yet
    @property
    def ttft_at(self) -> float: ...  # monotonic seconds of the last sample
    @property
    def picked_at(self) -> float: ...  # monotonic seconds the coordinator last reserved on it; 0: never
    @property
    def embedding_capacity(self) -> int: ...  # embedding requests it holds at once; 0: it serves none
    @property
    def embedding_requests(self) -> int: ...  # the coordinator's embedding requests on it now


@dataclass(frozen=True, slots=True)
class Request:
    demand: Demand
    model: str | None = None
    session_id: str | None = None
    session_worker: str | None = None  # the worker holding session_id, when the coordinator knows one
    prefer: str | None = None  # a worker likely to hold the prompt's prefix: first if it passes every filter
    # worker id -> share of the prompt's prefix it was sent before (coordinator/affinity/prefixes.py)
    prefix_match: Mapping[str, float] = field(default_factory=lambda: NO_MATCH)
    turn: int = 0  # the coordinator's request counter, for round-robin
    rng: random.Random | None = None  # the coordinator's seeded random source, for random


@dataclass(frozen=True, slots=True)
class Decision:
    """Either `ranked` (best first; try them in order) or a `reason` nobody could take it.
    `scores` is each ranked worker's weighted total (lower is better), `parts` its scorers' shares."""

    ranked: tuple[WorkerView, ...] = ()
    reason: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)
