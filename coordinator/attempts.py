"""Attempts: a request tried on its ranked workers in turn until one answers it (failover before the
first token), in one loop (`Tries`) for every kind of work sent to a worker: generations, embeddings
and the tokenizer's requests.

Owns: the loop (each try's span, the worker's breaker told a try begins, its verdict after: `judge`;
the bound on tries, a deadline shared by them, the failures counted and logged), and what each kind
holds during its try: a generation's reservation on the worker from admission (given back on a
failover; its `admitted` event confirms it and charges the prompt to the tenant's fair share; a
capacity refusal is noted for the worker, which knows of streams this coordinator does not, another
coordinator's, and counts as full until its next heartbeat), an embedding's slot. Also the answer
once no try succeeded (`Failovers`): the refusing workers' reason and the soonest Retry-After any of
them sent, or unavailable.
Must not: speak to workers (relay/dispatch.py, relay/embeddings.py and relay/tokens.py do), rank them
(scheduling/), or relay a stream once it has started (relay/stream.py).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

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
from serving.tracing import Trace

log = logging.getLogger("coordinator.requests")
T = TypeVar("T")
NOTHING_LOGGED: Mapping[str, object] = {}


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try, as the kind of work tried sees it."""

    worker: WorkerRecord
    number: int  # 1 for the first worker tried
    traceparent: str | None  # the try's span, to send on to the worker (W3C trace context)
    left: float | None  # seconds left of the deadline the tries share; None: they have none


class Tries:
    """The one loop of tries over ranked workers. A try that raises `Failover` moves on to the next worker
    (relay/dispatch.py says which answers do: a 503 or a reason in RETRYABLE_ON_OTHER_WORKER, a 5xx, a
    401, an unreachable or failing worker); anything else it raises stands, and no other worker is tried."""

    def __init__(self, breakers: Breakers, metrics: CoordinatorMetrics) -> None:
        self._breakers = breakers
        self._metrics = metrics

    async def first(self, ranked: Sequence[WorkerRecord], tried: Callable[[Attempt], Awaitable[T]], *,
                    at_most: int, request_id: str, trace: Trace, exhausted: Callable[[Failovers], CoordinatorError],
                    left: Callable[[], float] | None = None, judged_on_answer: bool = True,
                    logged: Mapping[str, object] = NOTHING_LOGGED) -> T:
        """What `tried` answers on the first of the first `at_most` workers of `ranked` that answers, or
        `exhausted`'s error. `left`: the seconds left of a deadline the tries share (a try begins only while
        some are). `judged_on_answer`: an answer closes the worker's breaker; False where the verdict
        waits for a stream's end (the relay's). `logged`: more fields for the failover log line."""
        failed = Failovers()
        for number, worker in enumerate(ranked[:at_most], start=1):
            remaining = None if left is None else left()
            if remaining is not None and remaining <= 0:
                break
            self._breakers.attempt(worker)
            span = trace.child("dispatch", {"llm_pool.worker": worker.worker_id, "llm_pool.attempt": number})
            try:
                answer = await tried(Attempt(worker, number, span.traceparent(), remaining))
            except Failover as failover:
                span.fail(failover.reason)
                judge(failover, worker.worker_id, request_id, self._breakers, self._metrics, **logged)
                failed.add(failover)
                continue
            except BaseException as exc:
                span.raised(exc)
                self._breakers.settled(worker.worker_id)
                raise
            finally:
                span.end()
            if judged_on_answer:
                self._breakers.succeeded(worker.worker_id)
            return answer
        raise exhausted(failed)


class Attempts:
    """A generation's tries: each holds a reservation on its worker from admission until the worker's
    first token (then the relay holds it), or gives it back on a failover."""

    def __init__(self, dispatcher: Dispatcher, admission: Admission, breakers: Breakers, metrics: CoordinatorMetrics,
                 *, max_attempts: int, retry_after: int, fair: FairShares | None = None) -> None:
        """`fair`: charged each admitted request's prompt tokens, for its tenant."""
        self._tries = Tries(breakers, metrics)
        self._dispatcher = dispatcher
        self._admission = admission
        self._fair = fair
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._retry_after = retry_after

    async def open(self, valid: Generation, ranked: Sequence[WorkerRecord], *,
                   reserved: Callable[[], None] | None = None, hints: PrefixHints | None = None) -> OpenStream:
        """`reserved` runs once, when the first attempt's reservation is made (before any await).
        `hints`: the prompt's prefix blocks, and the worker that was sent most of its prefix; any other
        worker tried is told it may fetch those cells from there (`GenerateRequest.prefix_peer`)."""
        placed = _Once(reserved)

        async def start(at: Attempt) -> OpenStream:
            reservation = self._admission.reserve(at.worker, valid.demand, valid.request.tenant)
            placed()
            try:
                stream = await self._dispatcher.start(at.worker, valid, reservation, hints,
                                                      admitted=functools.partial(self._admitted, valid, reservation),
                                                      traceparent=at.traceparent)
            except BaseException as exc:
                self._admission.release(reservation)
                if isinstance(exc, Failover) and exc.refused:
                    self._admission.refused(reservation, exc.reason)
                raise
            stream.attempts = at.number  # the worker's first event: the stream is started
            return stream

        return await self._tries.first(ranked, start, at_most=self._max_attempts, request_id=valid.request_id,
                                       trace=valid.trace, judged_on_answer=False,  # the relay judges at the end
                                       exhausted=lambda failed: failed.error("start the request", self._retry_after))

    def _admitted(self, valid: Generation, reservation: Reservation, prompt_tokens: int) -> None:
        """The worker took the request: its reservation made exact, its prompt charged to its tenant (once:
        not again for a continuation, relay/continuation.py)."""
        self._admission.confirm(reservation, prompt_tokens)
        if valid.request.generated is not None:
            return
        tenant = valid.request.tenant
        self._metrics.tenant_tokens.labels(tenant=tenant_label(tenant), kind="prompt").inc(prompt_tokens)
        if self._fair is not None:
            self._fair.charge_prompt(tenant, prompt_tokens)

    def release(self, stream: OpenStream) -> None:
        """A stream this opened, given back before its relay took it (a prefill's, once it is read)."""
        self._admission.release(stream.reservation)


class EmbeddingAttempts:
    """An embedding's tries: each holds an embedding slot on its worker while it waits for the vectors,
    and all share the request's deadline (EMBEDDING_TIMEOUT)."""

    def __init__(self, dispatcher: EmbeddingDispatcher, admission: EmbeddingAdmission, breakers: Breakers,
                 metrics: CoordinatorMetrics, *, max_attempts: int, timeout: float, now: Callable[[], float],
                 retry_after: int) -> None:
        self._tries = Tries(breakers, metrics)
        self._dispatcher = dispatcher
        self._admission = admission
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._now = now
        self._retry_after = retry_after

    async def embed(self, work: Embedding, ranked: Sequence[WorkerRecord], *,
                    reserved: Callable[[], None] | None = None) -> EmbedAnswer:
        """`reserved` runs once, when the first attempt's slot is held (before any await)."""
        deadline = self._now() + self._timeout
        placed = _Once(reserved)

        async def send(at: Attempt) -> EmbedAnswer:
            slot = self._admission.reserve(at.worker)
            placed()
            assert at.left is not None  # the tries share a deadline
            try:
                return EmbedAnswer(await self._dispatcher.send(at.worker, work, at.left, traceparent=at.traceparent),
                                   at.number)
            finally:
                self._admission.release(slot)

        def exhausted(failed: Failovers) -> CoordinatorError:
            if self._now() < deadline:
                return failed.error("embed the request", self._retry_after)
            last = failed.last
            return CoordinatorError(reasons.DEADLINE_EXCEEDED, f"not embedded within {self._timeout:g} s "
                                    f"({last.reason if last else 'no worker answered'})")

        return await self._tries.first(ranked, send, at_most=self._max_attempts, request_id=work.request_id,
                                       trace=work.trace, exhausted=exhausted, left=lambda: deadline - self._now(),
                                       logged={"embeddings": True})


class _Once:
    """`call` (when there is one), run the first time this is called and never again."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[], None] | None) -> None:
        self._call = call

    def __call__(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call()


@dataclass(slots=True)
class Failovers:
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
