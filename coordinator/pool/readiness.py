"""Readiness: whether this coordinator knows the pool well enough to take client traffic.

Owns: the rule for "knows the pool" and the wait for it. A coordinator that has just started knows
no worker: every request it took would be refused (`no_workers`, or 404 for a model it has not heard
of), though its siblings on the same port or behind the same Service could serve it. So it joins the
shared port (coordinator/server.py), and answers ready on `/coordinator/ready`, only once it knows the
pool, which is the first of:

- it has registered as many workers as the pool has: every worker passes on, in each heartbeat, the
  most alive workers a coordinator's last answer counted (`Heartbeat.pool_workers`: the siblings' view),
  and at least one worker, and SETTLE seconds since start (at a pool's first start, when no coordinator
  counts anyone yet, the workers beating at once get that long to register together);
- a heartbeat round has passed since start (`join_wait`, by default the heartbeat interval plus SETTLE):
  every live worker has beaten to it by then. A pool with no worker is one it knows.

Workers beat to a coordinator they have not reached within REACH_RETRY (worker/heartbeat.py), and a
new address at once; a restarted coordinator that they reached before hears from each at its next
interval, so that restart takes up to a round, its siblings serving meanwhile.

Once known it stays known: losing every worker later is `no_workers`, not a reason to leave.
Draining is never ready (coordinator/ops/drain.py).
Must not: open or close sockets (coordinator/server.py does, when told), or read the registry beyond
its count of alive workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from coordinator.clock import Clock
from protocol.health import JOIN_SETTLE as SETTLE

Status = Literal["ready", "joining", "draining"]


class Readiness:
    def __init__(self, *, clock: Clock, join_wait: float, workers: Callable[[], int], gated: bool = False) -> None:
        """`gated`: the process joins a shared port once the pool is known (coordinator/server.py), and
        is ready only once it has (`joined`), so that a sibling told to drain by the ready answer never
        leaves the port with nobody on it."""
        self._clock = clock
        self._gated = gated
        self._joined = False
        self._started = clock.monotonic()
        self._join_wait = join_wait
        self._workers = workers
        self._pool = 0  # the most workers a heartbeat said the pool has
        self._known = False
        self._heard = asyncio.Event()  # bound to a loop at its first wait, not here

    def known(self) -> bool:
        if not self._known:
            waited = self._clock.monotonic() - self._started
            self._known = waited >= self._join_wait or (
                waited >= SETTLE and self._workers() >= max(1, self._pool))
        return self._known

    def status(self, *, draining: bool) -> Status:
        if draining:
            return "draining"
        return "ready" if self.known() and (self._joined or not self._gated) else "joining"

    def joined(self) -> None:
        """The shared port listens now."""
        self._joined = True

    def heard(self, pool_workers: int) -> None:
        """A heartbeat was taken, from a worker that counts `pool_workers` in the pool: the wait looks
        again at once, not at its next tick."""
        self._pool = max(self._pool, pool_workers)
        self._heard.set()

    async def until_known(self) -> None:
        """Returns once the pool is known; each look is at most SETTLE / 4 after the last."""
        while not self.known():
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), SETTLE / 4)
            except TimeoutError:
                pass
