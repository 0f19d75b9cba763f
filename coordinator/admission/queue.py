"""The admission queue: where a request waits, per model, for capacity that is momentarily short.

Owns: one bounded FIFO of waiters per model, the wait's deadline, and the wake-ups. A request that
finds no capacity (or finds others already waiting for that model) joins the back of its model's
queue and waits to be woken or to time out; a woken request tries admission again and, if it still
does not fit, keeps its place at the head.
Must not: decide whether a request fits (admission.py and the scheduler do) or hold any worker
resource while a request waits.

O(1) throughout: joining and leaving are deque and dict operations; a release or a heartbeat wakes
only the head of that model's queue (`wake`), never scanning it, and a woken request that is
admitted wakes the next one (`admitted`), so freed capacity is handed down the line one request at a
time. A woken request leaves the queue as soon as it holds a reservation on a worker, before the
worker answers, so the next one tries while the first is still being dispatched; if that dispatch
is refused it comes back at the head (`rejoin`). A waiter whose client goes away leaves at once (its
entry is removed from the middle of the deque, which is O(n) in the queue's bound, itself a setting).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from coordinator.errors import CoordinatorError
from protocol import reasons


@dataclass(eq=False, slots=True)
class Waiter:
    model: str
    queued: bool = True  # holds a place in its model's queue
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class QueueClosed(Exception):
    """The client went away while its request waited."""


class AdmissionQueue:
    def __init__(self, *, size: int, timeout: float, retry_after: int) -> None:
        self.size = size
        self.timeout = timeout
        self._retry_after = retry_after
        self._queues: dict[str, collections.deque[Waiter]] = {}
        self.length = 0  # waiters over all models

    def waiting(self, model: str) -> int:
        queue = self._queues.get(model)
        return len(queue) if queue else 0

    def enabled(self) -> bool:
        return self.size > 0

    def join(self, model: str) -> Waiter:
        """Take a place at the back, or raise 503 `queue_full`."""
        queue = self._queues.setdefault(model, collections.deque())
        if len(queue) >= self.size:
            raise CoordinatorError(reasons.QUEUE_FULL, f"{len(queue)} requests already wait for {model!r}",
                                   retry_after=self._retry_after)
        waiter = Waiter(model)
        queue.append(waiter)
        self.length += 1
        return waiter

    def rejoin(self, waiter: Waiter) -> None:
        """Back at the head: it left when it was placed, and its dispatch was refused. Allowed past
        the bound: it held a place a moment ago."""
        if waiter.queued:
            return
        self._queues.setdefault(waiter.model, collections.deque()).appendleft(waiter)
        waiter.queued = True
        self.length += 1

    async def wait(self, waiter: Waiter, *, deadline: float, now: Callable[[], float],
                   client_gone: Callable[[], Awaitable[None]] | None) -> None:
        """Until woken (returns, still at the head), the deadline (503 `queue_timeout`) or the
        client leaving (`QueueClosed`). On either failure the waiter has left the queue."""
        if waiter.future.done():  # woken before it started to wait: a wake-up is never lost
            waiter.future = asyncio.get_running_loop().create_future()
            return
        watch = asyncio.ensure_future(client_gone()) if client_gone is not None else None
        try:
            waits: set[asyncio.Future[None]] = {waiter.future} if watch is None else {waiter.future, watch}
            done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - now()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watch is not None:
                watch.cancel()
        if waiter.future in done:
            waiter.future = asyncio.get_running_loop().create_future()  # spent: the next wait needs a new wake
            return
        self.leave(waiter)
        if watch is not None and watch in done:
            raise QueueClosed
        raise CoordinatorError(reasons.QUEUE_TIMEOUT, f"no capacity for {waiter.model!r} within "
                               f"{self.timeout:g} s", retry_after=self._retry_after)

    def is_head(self, waiter: Waiter) -> bool:
        queue = self._queues.get(waiter.model)
        return queue is not None and len(queue) > 0 and queue[0] is waiter

    def leave(self, waiter: Waiter) -> None:
        """Leave the queue (admitted, refused for good, timed out or gone); wakes the next one if it
        was at the head, so a departure never strands the queue."""
        queue = self._queues.get(waiter.model)
        if not waiter.queued or not queue:
            return
        was_head = queue[0] is waiter
        if was_head:
            queue.popleft()
        else:
            queue.remove(waiter)
        waiter.queued = False
        self.length -= 1
        if not queue:
            del self._queues[waiter.model]
        elif was_head:
            self.wake(waiter.model)

    def wake(self, model: str | None) -> None:
        """Capacity for `model` may have freed (None: for any model): let the head of its queue try."""
        if model is None:
            for name in list(self._queues):
                self.wake(name)
            return
        queue = self._queues.get(model)
        if queue and not queue[0].future.done():
            queue[0].future.set_result(None)
