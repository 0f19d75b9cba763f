"""Attempts (coordinator/attempts.py): the ranked workers tried in turn, each try holding a reservation
that a failover gives back, each worker judged by what its try said; over a dispatcher that plays the
workers' answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.admission.capacity import Admission
from coordinator.admission.demand import Demand
from coordinator.admission.embeddings import EmbeddingAdmission
from coordinator.attempts import Attempts, EmbeddingAttempts
from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics
from coordinator.pool.breaker import Breakers
from coordinator.pool.registry import ALIVE, STALE, Registry
from coordinator.relay.dispatch import Failover
from coordinator.upstream import WorkerRefused
from protocol import reasons
from serving.tracing import NO_TRACE, Trace
from tests.coordinator.fakes import heartbeat

pytestmark = pytest.mark.anyio


@dataclass
class Valid:  # what Attempts reads of a Generation
    demand: Demand = field(default_factory=lambda: Demand(prompt_bytes=10, max_tokens=20))
    request_id: str = "r1"
    request: Any = field(default_factory=lambda: SimpleNamespace(tenant="t:acme", generated=None))
    trace: Trace = NO_TRACE


@dataclass
class Started:  # what Attempts reads of an OpenStream
    reservation: Any
    attempts: int = 0


class Workers:
    """The dispatcher: each worker id's answer, in the order they are tried."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.tried: list[str] = []

    async def start(self, worker: Any, valid: Any, res: Any, hints: Any, *, admitted: Any, traceparent: str | None = None) -> Started:
        self.tried.append(worker.worker_id)
        answer = self.answers[worker.worker_id]
        if isinstance(answer, BaseException):
            raise answer
        admitted(answer)  # the prompt's tokens, as the worker's `admitted` event says
        return Started(res)


def pool(answers: dict[str, Any]) -> tuple[Attempts, Workers, Registry, Admission, Breakers]:
    clock = ManualClock()
    registry = Registry(stale_after=3.0, dead_after=6.0)
    for worker_id in answers:
        registry.upsert(heartbeat(worker_id, timestamp=clock.time()), clock.monotonic())
    admission = Admission(registry, clock, retry_after=2)
    breakers = Breakers(registry, clock.monotonic, threshold=3, cooldown=2.0, max_cooldown=60.0)
    workers = Workers(answers)
    attempts = Attempts(workers, admission, breakers, CoordinatorMetrics(), max_attempts=3,  # type: ignore[arg-type]
                        retry_after=9)
    return attempts, workers, registry, admission, breakers


def refused(retry_after: int | None = None) -> Failover:
    return Failover(reasons.KV_FULL, refused=True, retry_after=retry_after)


def gone() -> Failover:
    failover = Failover(reasons.WORKER_UNAVAILABLE, refused=False)
    failover.__cause__ = WorkerRefused("connection refused")
    return failover


async def test_a_refusal_gives_its_reservation_back_and_the_next_worker_starts_it_confirmed() -> None:
    attempts, workers, registry, admission, _ = pool({"a": refused(5), "b": 7})
    ranked = [registry.get("a"), registry.get("b")]
    stream = await attempts.open(Valid(), ranked)  # type: ignore[arg-type]
    assert workers.tried == ["a", "b"] and stream.attempts == 2
    assert admission.in_flight == 1 and stream.reservation.worker_id == "b"
    assert registry.get("a").in_flight == 0 and registry.get("a").breaker_failures == 0  # type: ignore[union-attr]
    attempts.release(stream)
    assert admission.in_flight == 0 and registry.get("b").in_flight == 0  # type: ignore[union-attr]


async def test_a_worker_whose_port_refuses_is_judged_gone_and_one_that_fails_is_counted() -> None:
    attempts, _, registry, _, _ = pool({"a": gone(), "b": Failover(reasons.WORKER_FAILED, False), "c": 3})
    ranked = [registry.get(w) for w in "abc"]
    await attempts.open(Valid(), ranked)  # type: ignore[arg-type]
    assert registry.get("a").state == STALE and registry.get("b").state == ALIVE  # type: ignore[union-attr]
    assert registry.get("b").breaker_failures == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(("hints", "expected"), [((5, 2), 2), ((None, 4), 4), ((None, None), 9)])
async def test_when_every_worker_refuses_the_answer_is_their_reason_and_the_soonest_retry_after(
        hints: tuple[int | None, int | None], expected: int) -> None:
    attempts, _, registry, admission, _ = pool({"a": refused(hints[0]), "b": refused(hints[1])})
    with pytest.raises(CoordinatorError) as caught:
        await attempts.open(Valid(), [registry.get("a"), registry.get("b")])  # type: ignore[list-item]
    assert caught.value.reason == reasons.KV_FULL and caught.value.retry_after == expected
    assert admission.in_flight == 0


async def test_anything_else_a_try_raises_gives_the_reservation_back_and_stands() -> None:
    attempts, _, registry, admission, _ = pool({"a": CoordinatorError(reasons.INVALID_REQUEST, "bad")})
    with pytest.raises(CoordinatorError):
        await attempts.open(Valid(), [registry.get("a")])  # type: ignore[list-item]
    assert admission.in_flight == 0 and registry.get("a").breaker_failures == 0  # type: ignore[union-attr]


class Embedders:
    """The embedding dispatcher: each worker id refuses with its Retry-After."""

    def __init__(self, hints: dict[str, int | None]) -> None:
        self.hints = hints

    async def send(self, worker: Any, work: Any, left: float, *, traceparent: str | None = None) -> Any:
        raise refused(self.hints[worker.worker_id])


@pytest.mark.parametrize(("hints", "expected"), [((5, 2), 2), ((2, None), 2), ((None, None), 9)])
async def test_an_embedding_every_worker_refused_carries_the_soonest_retry_after_too(
        hints: tuple[int | None, int | None], expected: int) -> None:
    """As for generations (protocol/inference.http.md); it was the last worker's."""
    clock = ManualClock()
    registry = Registry(stale_after=3.0, dead_after=6.0)
    for worker_id in "ab":
        registry.upsert(heartbeat(worker_id, timestamp=clock.time()), clock.monotonic())
    breakers = Breakers(registry, clock.monotonic, threshold=3, cooldown=2.0, max_cooldown=60.0)
    attempts = EmbeddingAttempts(Embedders(dict(zip("ab", hints, strict=True))),  # type: ignore[arg-type]
                                 EmbeddingAdmission(registry, clock, retry_after=2), breakers, CoordinatorMetrics(),
                                 max_attempts=3,
                                 timeout=30.0, now=clock.monotonic, retry_after=9)
    with pytest.raises(CoordinatorError) as caught:
        await attempts.embed(Valid(), [registry.get("a"), registry.get("b")])  # type: ignore[arg-type, list-item]
    assert caught.value.reason == reasons.KV_FULL and caught.value.retry_after == expected
