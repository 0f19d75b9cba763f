"""The relay's per-stream buffer: a bounded FIFO between the reader (and the stream's timer) and the writer.

Owns: holding at most `maxsize` events and waking whichever side waits.
Must not: drop anything: a full buffer refuses (`put_nowait` is False) or makes the producer wait.

Why not `asyncio.Queue`: it keeps three deques and a waiter list per queue, for any number of
producers and consumers. A relayed stream has one consumer and one waiting producer, and one
buffer per open stream: at thousands of streams its size and its cost per token are the relay's.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class EventBuffer(Generic[T]):
    __slots__ = ("_getter", "_items", "_putter", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._items: collections.deque[T] = collections.deque()
        self._getter: asyncio.Future[None] | None = None  # the consumer, waiting for an item
        self._putter: asyncio.Future[None] | None = None  # the producer, waiting for room

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> bool:
        """Appends and returns True, or returns False when the buffer is full."""
        if len(self._items) >= self.maxsize:
            return False
        self._items.append(item)
        _wake(self._getter)
        return True

    def put_last(self, item: T) -> None:
        """Appends the stream's final item even when full: at most one past `maxsize`, so a stream
        that must end (an abort, an internal fault) never waits on a reader that may be gone."""
        self._items.append(item)
        _wake(self._getter)

    async def put(self, item: T, timeout: float) -> bool:
        """Appends, waiting up to `timeout` seconds for room; False when there was none in time."""
        if self.put_nowait(item):
            return True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while len(self._items) >= self.maxsize:
                    self._putter = loop.create_future()
                    await self._putter
        except TimeoutError:
            return False
        finally:
            self._putter = None
        return self.put_nowait(item)

    def take(self, limit: int) -> list[T]:
        """Up to `limit` items already here, without waiting (an empty list when there are none)."""
        items = self._items
        taken = [items.popleft() for _ in range(min(limit, len(items)))]
        if taken:
            _wake(self._putter)
        return taken

    async def get(self) -> T:
        while not self._items:
            self._getter = asyncio.get_running_loop().create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        item = self._items.popleft()
        _wake(self._putter)
        return item


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
