"""The admission queue: where a request waits, per model, for capacity that is momentarily short.

Owns: per model, one bounded FIFO line of waiters per priority class and tenant, which line goes
next (the highest class waiting; within it, the tenant whose fair-share counter is lowest:
fairness.py), the wait's deadline, and the wake-ups. A request
that finds no capacity (or finds others already waiting for that model) joins the back of its
tenant's line and waits to be woken or to time out; a woken request tries admission again and, if it
still does not fit, keeps its place at the head of its line.
Must not: decide whether a request fits (admission.py and the scheduler do), keep the counters
(fairness.py does), or hold any worker resource while a request waits.

Joining and leaving are deque and dict operations; the next tenant is found in O(log tenants)
(`Lowest`). A release or a heartbeat wakes only the head of that model's queue (`wake`), never
scanning it, and a woken request that is admitted wakes the next one (`leave`), so freed capacity is
handed down the line one request at a time. A woken request leaves the queue as soon as it holds a
reservation on a worker, before the worker answers, so the next one tries while the first is still
being dispatched; if that dispatch is refused it comes back at the head of its line (`rejoin`). A
waiter whose client goes away leaves at once (its entry is removed from the middle of its line, which
is O(n) in the line's bound, itself a setting). Without fair shares (`fair` None) every request is in
one line per model: first come, first served.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from coordinator.admission.fairness import FairShares, Lowest
from coordinator.errors import CoordinatorError
from protocol import reasons


@dataclass(eq=False, slots=True)
class Waiter:
    model: str
    tenant: str = ""
    rank: int = 0  # its priority class's rank: a higher one goes first
    queued: bool = True  # holds a place in its model's queue
    woken: bool = False  # has been given a turn at least once
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def line(self) -> tuple[int, str]:
        return self.rank, self.tenant


class QueueClosed(Exception):
    """The client went away while its request waited."""


class _ModelQueue:
    """One model's waiters: a line per priority class and tenant, and the line that goes next (the
    highest class with a waiter; within it, the tenant whose counter is lowest)."""

    __slots__ = ("_counter", "length", "lines", "next")

    def __init__(self, counter: Callable[[str], float]) -> None:
        self._counter = counter
        self.lines: dict[tuple[int, str], collections.deque[Waiter]] = {}
        self.next: dict[int, Lowest] = {}  # rank -> the tenants with a waiter of that class, by counter
        self.length = 0

    def head(self) -> Waiter | None:
        for rank in sorted(self.next, reverse=True):  # a class or two: O(1)
            tenant = self.next[rank].lowest()
            if tenant is not None:
                return self.lines[(rank, tenant)][0]
        return None

    def add(self, waiter: Waiter, *, front: bool = False) -> None:
        line = self.lines.get(waiter.line)
        if line is None:
            line = self.lines[waiter.line] = collections.deque()
            if waiter.rank not in self.next:
                self.next[waiter.rank] = Lowest(self._counter)
            self.next[waiter.rank].add(waiter.tenant)
        if front:
            line.appendleft(waiter)
        else:
            line.append(waiter)
        self.length += 1

    def remove(self, waiter: Waiter) -> None:
        line = self.lines[waiter.line]
        if line[0] is waiter:
            line.popleft()
        else:
            line.remove(waiter)
        self.length -= 1
        if not line:
            del self.lines[waiter.line]
            tenants = self.next[waiter.rank]
            tenants.discard(waiter.tenant)
            if not len(tenants):
                del self.next[waiter.rank]


class AdmissionQueue:
    def __init__(self, *, size: int, timeout: float, retry_after: int, fair: FairShares | None = None) -> None:
        """`size`: waiters per model and tenant. `fair`: the tenants' counters, which order the lines;
        None: one line per model, whoever the tenant."""
        self.size = size
        self.timeout = timeout
        self._retry_after = retry_after
        self._fair = fair
        self._counter: Callable[[str], float] = fair.counter if fair is not None else (lambda _tenant: 0.0)
        self._queues: dict[str, _ModelQueue] = {}
        self.length = 0  # waiters over all models

    def waiting(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.length if queue else 0

    def waiting_tenants(self, model: str, limit: int) -> list[str]:
        """The tenants with a request waiting for `model` (at most `limit`): O(their number). None
        without fair shares: the one line is no tenant's."""
        queue = self._queues.get(model)
        if queue is None or self._fair is None:
            return []
        return list(dict.fromkeys(tenant for _rank, tenant in queue.lines))[:limit]

    def enabled(self) -> bool:
        return self.size > 0

    def join(self, model: str, tenant: str = "", rank: int = 0) -> Waiter:
        """Take a place at the back of the line of the tenant's requests of that class, or raise 503
        `queue_full`."""
        waiter = Waiter(model, tenant if self._fair is not None else "", rank)
        queue = self._queue(model)
        line = queue.lines.get(waiter.line)
        if line is not None and len(line) >= self.size:
            whose = " of this key's tenant" if waiter.tenant else ""
            raise CoordinatorError(reasons.QUEUE_FULL, f"{len(line)} requests{whose} already wait for {model!r}",
                                   retry_after=self._retry_after)
        queue.add(waiter)
        self.length += 1
        return waiter

    def rejoin(self, waiter: Waiter) -> None:
        """Back at the head of its line: it left when it was placed, and its dispatch was refused.
        Allowed past the bound: it held a place a moment ago."""
        if waiter.queued:
            return
        self._queue(waiter.model).add(waiter, front=True)
        waiter.queued = True
        self.length += 1

    def _queue(self, model: str) -> _ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue(self._counter)
        return queue

    async def wait(self, waiter: Waiter, *, deadline: float, now: Callable[[], float],
                   client_gone: Callable[[], Awaitable[None]] | None) -> None:
        """Until woken (returns, still in its place), the deadline (503 `queue_timeout`) or the
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
        """Whether `waiter` goes next for its model."""
        queue = self._queues.get(waiter.model)
        return queue is not None and queue.head() is waiter

    def leave(self, waiter: Waiter) -> None:
        """Leave the queue (admitted, refused for good, timed out or gone); passes the turn on if it
        had it, or was next, so a departure never strands the queue."""
        queue = self._queues.get(waiter.model)
        if not waiter.queued or queue is None:
            return
        had_turn = waiter.woken or queue.head() is waiter
        queue.remove(waiter)
        waiter.queued = False
        self.length -= 1
        if not queue.length:
            del self._queues[waiter.model]
        elif had_turn:
            self.wake(waiter.model)

    def wake(self, model: str | None) -> None:
        """Capacity for `model` may have freed (None: for any model): let the request that goes next
        for it try."""
        if model is None:
            for name in list(self._queues):
                self.wake(name)
            return
        queue = self._queues.get(model)
        head = queue.head() if queue is not None else None
        if head is not None and not head.future.done():
            head.woken = True
            head.future.set_result(None)
