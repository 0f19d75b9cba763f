"""Attempts: a request tried on its ranked workers in turn until one starts it (failover before the
first token), for generations and for embeddings.

Owns: the order of each try (a reservation on the worker, or an embedding slot, from admission; the
worker's breaker told; the request started by the relay; its `admitted` event confirming the
reservation and charging the prompt to the tenant's fair share), and on a failover: the reservation given back, a capacity refusal noted for the worker
(it knows of streams this coordinator does not, another coordinator's, and counts as full until its
next heartbeat), and the worker's verdict (`judge`). Also the bound on tries, an embedding request's
deadline shared by its tries, and the Retry-After of an answer every worker refused.
Must not: speak to workers (relay/dispatch.py and relay/embeddings.py do), rank them (scheduling/), or
relay a stream once it has started (relay/stream.py).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.admission.capacity import Admission, Reservation
from coordinator.admission.embeddings import EmbeddingAdmission
from coordinator.admission.fairness import FairShares
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.metrics import CoordinatorMetrics, tenant_label
from coordinator.pool.breaker import Breakers
from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import Dispatcher, Failover, OpenStream, PrefixHints
from coordinator.relay.embeddings import EmbedAnswer, EmbeddingDispatcher
from coordinator.upstream import WorkerRefused
from protocol import reasons

log = logging.getLogger("coordinator.requests")


class Attempts:
    def __init__(self, dispatcher: Dispatcher, admission: Admission, breakers: Breakers, metrics: CoordinatorMetrics,
                 *, max_attempts: int, retry_after: int, fair: FairShares | None = None) -> None:
        """`fair`: charged each admitted request's prompt tokens, for its tenant."""
        self._dispatcher = dispatcher
        self._admission = admission
        self._fair = fair
        self._breakers = breakers
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._retry_after = retry_after

    async def open(self, valid: Generation, ranked: Sequence[WorkerRecord], *,
                   reserved: Callable[[], None] | None = None, hints: PrefixHints | None = None) -> OpenStream:
        """`reserved` runs once, when the first attempt's reservation is made (before any await).
        `hints`: the prompt's prefix blocks, and the worker that was sent most of its prefix; any other
        worker tried is told it may fetch those cells from there (`GenerateRequest.prefix_peer`)."""
        failed = _Failovers()
        for attempt, worker in enumerate(ranked[: self._max_attempts], start=1):
            reservation = self._admission.reserve(worker, valid.demand, valid.request.tenant)
            if reserved is not None:
                reserved()
                reserved = None
            self._breakers.attempt(worker)
            span = valid.trace.child("dispatch", {"llm_pool.worker": worker.worker_id, "llm_pool.attempt": attempt})
            try:
                stream = await self._dispatcher.start(worker, valid, reservation, hints,
                                                      admitted=functools.partial(self._admitted, valid, reservation),
                                                      traceparent=span.traceparent())
            except Failover as failover:
                span.fail(failover.reason)
                span.end()
                self._admission.release(reservation)
                if failover.refused:
                    self._admission.refused(reservation, failover.reason)
                judge(failover, worker.worker_id, valid.request_id, self._breakers, self._metrics)
                failed.add(failover)
                continue
            except BaseException as exc:
                span.raised(exc)
                span.end()
                self._admission.release(reservation)
                self._breakers.settled(worker.worker_id)
                raise
            span.end()  # the worker's first event: the stream is started
            stream.attempts = attempt
            return stream
        raise failed.error("start the request", self._retry_after)

    def _admitted(self, valid: Generation, reservation: Reservation, prompt_tokens: int) -> None:
        """The worker took the request: its reservation made exact, its prompt charged to its tenant."""
        self._admission.confirm(reservation, prompt_tokens)
        tenant = valid.request.tenant
        self._metrics.tenant_tokens.labels(tenant=tenant_label(tenant), kind="prompt").inc(prompt_tokens)
        if self._fair is not None:
            self._fair.charge_prompt(tenant, prompt_tokens)

    def release(self, stream: OpenStream) -> None:
        """A stream this opened, given back before its relay took it (a prefill's, once it is read)."""
        self._admission.release(stream.reservation)


class EmbeddingAttempts:
    def __init__(self, dispatcher: EmbeddingDispatcher, admission: EmbeddingAdmission, breakers: Breakers,
                 metrics: CoordinatorMetrics, *, max_attempts: int, timeout: float, now: Callable[[], float],
                 retry_after: int) -> None:
        self._dispatcher = dispatcher
        self._admission = admission
        self._breakers = breakers
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._now = now
        self._retry_after = retry_after

    async def embed(self, work: Embedding, ranked: Sequence[WorkerRecord], *,
                    reserved: Callable[[], None] | None = None) -> EmbedAnswer:
        """`reserved` runs once, when the first attempt's slot is held (before any await)."""
        deadline = self._now() + self._timeout
        failed = _Failovers()
        for attempt, worker in enumerate(ranked[: self._max_attempts], start=1):
            left = deadline - self._now()
            if left <= 0:
                break
            slot = self._admission.reserve(worker)
            if reserved is not None:
                reserved()
                reserved = None
            self._breakers.attempt(worker)
            span = work.trace.child("dispatch", {"llm_pool.worker": worker.worker_id, "llm_pool.attempt": attempt})
            try:
                response = await self._dispatcher.send(worker, work, left, traceparent=span.traceparent())
            except Failover as failover:
                span.fail(failover.reason)
                judge(failover, worker.worker_id, work.request_id, self._breakers, self._metrics, embeddings=True)
                failed.add(failover)
                continue
            except BaseException as exc:
                span.raised(exc)
                self._breakers.settled(worker.worker_id)
                raise
            finally:
                span.end()
                self._admission.release(slot)
            self._breakers.succeeded(worker.worker_id)
            return EmbedAnswer(response, attempt)
        if self._now() >= deadline:
            last = failed.last
            raise CoordinatorError(reasons.DEADLINE_EXCEEDED, f"not embedded within {self._timeout:g} s "
                                   f"({last.reason if last else 'no worker answered'})")
        raise failed.error("embed the request", self._retry_after)


@dataclass(slots=True)
class _Failovers:
    """What the tries of one request said so far."""

    last: Failover | None = None
    refused_only: bool = True  # every try was a refusal (no worker failed)
    soonest: int | None = None  # the shortest Retry-After a refusing worker sent

    def add(self, failover: Failover) -> None:
        self.last, self.refused_only = failover, self.refused_only and failover.refused
        if failover.retry_after is not None:
            self.soonest = min(failover.retry_after, self.soonest if self.soonest is not None else failover.retry_after)

    def error(self, doing: str, retry_after: int) -> CoordinatorError:
        """The answer once no try started it: every worker refused, with their reason and the soonest any
        of them expects room (`retry_after`, the coordinator's own, when none said); else unavailable."""
        last = self.last
        if last is not None and self.refused_only:
            return CoordinatorError(last.reason, f"every eligible worker refused: {last.reason}",
                                    retry_after=self.soonest if self.soonest is not None else retry_after)
        return CoordinatorError(reasons.WORKER_UNAVAILABLE,
                                f"no worker could {doing} ({last.reason if last else 'none tried'})")


def judge(failover: Failover, worker_id: str, request_id: str, breakers: Breakers, metrics: CoordinatorMetrics,
          **logged: object) -> None:
    """The verdict an attempt that failed over gives its worker, counted and logged: a refusal (capacity,
    a wait of the request's own) is the worker working; a refused connection means it is gone."""
    if failover.refused:
        breakers.settled(worker_id)
    else:
        breakers.failed(worker_id)
    if isinstance(failover.__cause__, WorkerRefused):
        breakers.gone(worker_id)
    metrics.failovers.labels(reason=failover.reason).inc()
    log.warning(json.dumps({"event": "failover", "request_id": request_id, "worker_id": worker_id,
                            "reason": failover.reason, **logged,
                            "detail": repr(failover.__cause__) if failover.__cause__ else None}))
