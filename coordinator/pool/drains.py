"""One task per draining worker, once a drain: what a drain's moves (kept sessions, pool/moves.py; stored
responses, pool/records.py) share.

Owns: starting a worker's task when its heartbeat first says `draining` (every heartbeat says it until the
worker stops, and the work is done once a drain), remembering the drains dealt with (bounded: the oldest
forgotten, so a very old one could be moved again), forgetting one when the worker serves again (a restart
under the same id: its next drain moves again), and cancelling the tasks at close. A task's own faults are
its to log; whatever way it ends, its drain counts as dealt with.
Must not: know what is moved.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

REMEMBERED = 4096  # drained workers remembered as dealt with


class OncePerDrain:
    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._remembered = remembered
        self._running: dict[str, asyncio.Task[None]] = {}  # by worker id
        self._done: OrderedDict[str, None] = OrderedDict()

    def start(self, worker_id: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `work()` for `worker_id`'s drain, unless it runs or ran for this drain already."""
        if worker_id in self._running or worker_id in self._done:
            return
        self._running[worker_id] = asyncio.create_task(self._run(worker_id, work))

    def serving(self, worker_id: str) -> None:
        self._done.pop(worker_id, None)

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, worker_id: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await work()
        finally:
            self._running.pop(worker_id, None)
            self._done[worker_id] = None
            while len(self._done) > self._remembered:
                self._done.popitem(last=False)
