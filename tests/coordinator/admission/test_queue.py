"""The admission queue on its own: bounds, FIFO wake-ups, deadlines, leaving from anywhere."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.admission.queue import AdmissionQueue, QueueClosed
from coordinator.errors import CoordinatorError

pytestmark = pytest.mark.anyio


def queue(size: int = 3, timeout: float = 5.0) -> AdmissionQueue:
    return AdmissionQueue(size=size, timeout=timeout, retry_after=2)


async def test_a_full_queue_refuses_at_once_per_model() -> None:
    q = queue(size=2)
    a, b = q.join("m"), q.join("m")
    with pytest.raises(CoordinatorError) as full:
        q.join("m")
    assert (full.value.reason, full.value.status, full.value.retry_after) == ("queue_full", 503, 2)
    other = q.join("other")  # each model has its own bound
    assert (q.waiting("m"), q.waiting("other"), q.length) == (2, 1, 3)
    for w in (a, b, other):
        q.leave(w)
    assert q.length == 0 and q.waiting("m") == 0


async def test_wake_reaches_only_the_head_and_leaving_passes_it_on() -> None:
    q = queue()
    first, second = q.join("m"), q.join("m")
    q.wake("m")
    assert first.future.done() and not second.future.done()
    q.leave(first)  # admitted: the next one may try now
    assert second.future.done() and q.is_head(second)


async def test_leaving_from_the_middle_wakes_nobody() -> None:
    q = queue()
    head, middle, tail = q.join("m"), q.join("m"), q.join("m")
    q.leave(middle)
    assert not head.future.done() and not tail.future.done() and q.waiting("m") == 2


async def test_the_deadline_ends_the_wait_with_queue_timeout_and_leaves() -> None:
    q = queue(timeout=0.05)
    waiter = q.join("m")
    started = time.monotonic()
    with pytest.raises(CoordinatorError) as late:  # wait_for: a wait that ignores its deadline fails, not hangs
        await asyncio.wait_for(q.wait(waiter, deadline=started + 0.05, now=time.monotonic, client_gone=None), 2)
    assert late.value.reason == "queue_timeout" and q.waiting("m") == 0


async def test_a_client_that_goes_away_leaves_the_queue_at_once() -> None:
    q = queue()
    head, gone = q.join("m"), q.join("m")
    left = asyncio.Event()

    async def client_gone() -> None:
        await left.wait()

    waiting = asyncio.create_task(q.wait(gone, deadline=time.monotonic() + 10, now=time.monotonic,
                                         client_gone=client_gone))
    await asyncio.sleep(0.01)
    left.set()
    with pytest.raises(QueueClosed):
        await waiting
    assert q.waiting("m") == 1 and q.is_head(head)


async def test_a_woken_head_that_still_does_not_fit_waits_again_in_its_place() -> None:
    q = queue()
    head, behind = q.join("m"), q.join("m")
    q.wake("m")
    await q.wait(head, deadline=time.monotonic() + 1, now=time.monotonic, client_gone=None)
    # It tried and failed: it waits again, at the head, until the next wake-up.
    again = asyncio.create_task(q.wait(head, deadline=time.monotonic() + 1, now=time.monotonic, client_gone=None))
    await asyncio.sleep(0.01)
    assert not again.done() and q.is_head(head) and not behind.future.done()
    q.wake(None)  # any model
    await again


async def test_a_waiter_that_left_when_placed_rejoins_at_the_head_even_when_full() -> None:
    q = queue(size=2)
    head, behind = q.join("m"), q.join("m")
    q.leave(head)  # placed: the next one may try
    assert behind.future.done() and not head.queued
    q.join("m")  # its place is taken: the queue is full again
    q.rejoin(head)  # its dispatch was refused: back in front, past the bound
    assert q.is_head(head) and (q.waiting("m"), q.length) == (3, 3)
    q.rejoin(head)  # once only
    assert q.length == 3
    q.leave(head)
    q.leave(head)  # leaving twice is harmless
    assert q.length == 2 and q.is_head(behind)
