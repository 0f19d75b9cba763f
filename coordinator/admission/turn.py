"""Admission in turn: a request tries to be placed behind the requests already waiting for its model,
and waits in the queue (bounded in length and time) while capacity is short.

Owns: the loop between the queue (queue.py) and a placement attempt: join the back of the tenant's
line when others wait or when the attempt is refused for a reason worth waiting for (capacity short;
the caller may add others: a model loading, a swap under way), wait to be woken, try again, hand the
place on as soon as a worker's capacity is reserved, and come back at the head when that worker
refuses after all. This is the one way a request waits: no loop of its own polls.
Must not: decide whether a request fits (the attempt does) or hold a worker resource while it waits.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coordinator.admission.queue import AdmissionQueue, QueueClosed
from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics
from protocol import reasons

T = TypeVar("T")
# Capacity that is short for now, not a request that cannot be served: worth waiting for.
QUEUEABLE = frozenset({reasons.SESSIONS_FULL, reasons.KV_FULL, reasons.EMBEDDINGS_FULL})


def queueable(exc: CoordinatorError) -> bool:
    return exc.reason in QUEUEABLE


def _waited_for(exc: CoordinatorError, last: CoordinatorError | None, model: str, timeout: float
                ) -> CoordinatorError:
    """A timeout names what the request waited for when that was not capacity (a load, a swap)."""
    if exc.reason == reasons.QUEUE_TIMEOUT and last is not None and not queueable(last):
        return CoordinatorError(exc.reason, f"{model!r}: not served within {timeout:g} s ({last.message})",
                                retry_after=exc.retry_after)
    return exc


# `placed` runs once a worker's capacity is reserved for the request, before that worker answers.
Attempt = Callable[[Callable[[], None] | None], Awaitable[T]]


async def in_turn(queue: AdmissionQueue, model: str, attempt: Attempt[T], *, started: float,
                  now: Callable[[], float], metrics: CoordinatorMetrics,
                  client_gone: Callable[[], Awaitable[None]] | None, tenant: str = "", rank: int = 0,
                  waits: Callable[[CoordinatorError], bool] = queueable) -> T:
    """`attempt`'s result, once it succeeds in this request's turn; its `CoordinatorError` when not
    queueable, or 503 `queue_full` / `queue_timeout`, or `client_gone` if the client left while waiting.
    It waits in the line of `tenant`'s requests of its priority class (`rank`): the highest class goes
    first, and within it the tenant whose fair-share counter is lowest. `waits`: whether a refusal is worth
    waiting for (by default, capacity short for now)."""
    waiter = None
    last: CoordinatorError | None = None  # the last refusal it waited for
    deadline = started + queue.timeout
    try:
        if queue.waiting(model):
            waiter = queue.join(model, tenant, rank)  # no overtaking the requests already waiting
            if queue.is_head(waiter):
                queue.wake(model)  # its tenant goes next (fair shares): it tries at once
        while True:
            placed = None
            if waiter is not None:
                await queue.wait(waiter, deadline=deadline, now=now, client_gone=client_gone)
                placed = functools.partial(queue.leave, waiter)  # the next may try while this dispatches
            try:
                result = await attempt(placed)
            except CoordinatorError as exc:
                if not waits(exc):
                    raise
                last = exc
                if waiter is None:
                    waiter = queue.join(model, tenant, rank)
                else:
                    queue.rejoin(waiter)  # placed, then refused by the worker: back at the head
                continue
            if waiter is not None:
                metrics.dequeued("admitted", now() - started, tenant)
            return result
    except QueueClosed:
        metrics.dequeued(reasons.CLIENT_GONE, now() - started, tenant)
        raise CoordinatorError(reasons.CLIENT_GONE, "the client went away while its request waited") from None
    except CoordinatorError as exc:
        if exc.reason in (reasons.QUEUE_FULL, reasons.QUEUE_TIMEOUT):
            metrics.dequeued(exc.reason, now() - started, tenant)
        raise _waited_for(exc, last, model, queue.timeout) from None
    finally:
        if waiter is not None:
            queue.leave(waiter)  # admitted or not: the next one may try now
