"""The scheduler: a pure function from one request and worker snapshots to a decision.

Owns: the filters (alive, serves the model, not draining, session headroom, KV headroom), the two
scorers (session load, KV load, each in [0, 1], lower is better), their weights, the picker, session
affinity (a hard rule) and prefix preference (a soft one: an eligible preferred worker goes first).
Must not: do I/O, read a clock or random source it was not given, or change the workers it reads.
The registry's records are passed in as they are; `select` only reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.demand import Demand
from protocol import reasons

SESSION_WEIGHT = 0.6
KV_WEIGHT = 0.4


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
    def kv_reserved_bytes(self) -> int: ...
    @property
    def kv_capacity_bytes(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def session_max_tokens(self) -> int: ...
    @property
    def draining(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Request:
    demand: Demand
    model: str | None = None
    session_id: str | None = None
    session_worker: str | None = None  # the worker holding session_id, when the coordinator knows one
    prefer: str | None = None  # a worker likely to hold the prompt's prefix: first if it passes every filter


@dataclass(frozen=True, slots=True)
class Decision:
    """Either `ranked` (best first; try them in order) or a `reason` nobody could take it."""

    ranked: tuple[WorkerView, ...] = ()
    reason: str | None = None
    scores: dict[str, float] = field(default_factory=dict)


def session_load(w: WorkerView) -> float:
    return min(1.0, w.sessions / w.max_sessions)


def kv_load(w: WorkerView) -> float:
    return min(1.0, w.kv_reserved_bytes / w.kv_capacity_bytes)


def score(w: WorkerView) -> float:
    return SESSION_WEIGHT * session_load(w) + KV_WEIGHT * kv_load(w)


def select(request: Request, workers: Iterable[WorkerView], *, now: float, stale_after: float) -> Decision:
    """Filter, score, rank. `now` and `stale_after` are monotonic seconds, as in `last_seen`."""
    if request.session_worker is not None:
        return _affinity(request, workers, now=now, stale_after=stale_after)
    # Filters run in order; when one leaves nothing, its reason is the answer.
    stages: list[tuple[str, list[WorkerView]]] = []
    alive = [w for w in workers if now - w.last_seen < stale_after]
    stages.append((reasons.NO_WORKERS, alive))
    model = [w for w in alive if request.model is None or w.model == request.model]
    stages.append((reasons.MODEL_UNAVAILABLE, model))
    open_ = [w for w in model if not w.draining]
    stages.append((reasons.DRAINING, open_))
    seats = [w for w in open_ if not request.demand.new_session or w.sessions < w.max_sessions]
    stages.append((reasons.SESSIONS_FULL, seats))
    room = [w for w in seats if _kv_free(w) >= request.demand.tokens(w.session_max_tokens) * w.bytes_per_token]
    stages.append((reasons.KV_FULL, room))
    for reason, left in stages:
        if not left:
            return Decision(reason=reason)
    scores = {w.worker_id: score(w) for w in room}
    # Ties go to the lower worker id so the same inputs always give the same answer.
    ranked = tuple(sorted(room, key=lambda w: (w.worker_id != request.prefer, scores[w.worker_id], w.worker_id)))
    return Decision(ranked=ranked, scores=scores)


def _affinity(request: Request, workers: Iterable[WorkerView], *, now: float, stale_after: float) -> Decision:
    """A known session goes to its worker or nowhere: its KV cache lives there and nowhere else.

    Headroom is not checked here: the session already holds its slot, and the worker itself
    answers 503/413 if the next turn does not fit.
    """
    for w in workers:
        if w.worker_id == request.session_worker:
            if now - w.last_seen < stale_after and (request.model is None or w.model == request.model):
                return Decision(ranked=(w,), scores={w.worker_id: score(w)})
            break
    return Decision(reason=reasons.UNKNOWN_SESSION)


def _kv_free(w: WorkerView) -> int:
    return w.kv_capacity_bytes - w.kv_reserved_bytes
