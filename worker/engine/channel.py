"""A bounded one-way channel from the engine thread to one request's asyncio consumer.

Owns: the per-request buffer of stream items, its bound, the consumer's cancel flag and how long the
buffer has been full. Must not: block the engine thread, ever. The engine checks `has_room()` before
producing the next token for a request; a full channel pauses only that request (its sequence skips
decode steps) and the engine cancels it once it has stayed full past the slow-consumer deadline.
The terminal item (done or error) may exceed the bound by one, so a stream always ends explicitly.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class TokenChannel(Generic[T]):
    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("channel capacity must be at least 1")
        self._loop = loop
        self._capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._ready = asyncio.Event()
        self.cancelled = False  # set by the consumer; read by the engine at its next step
        self.full_since: float | None = None  # engine clock, set by the engine while full
        self.closed = False  # the terminal item has been pushed

    # -- engine thread -----------------------------------------------------------------------------

    def has_room(self) -> bool:
        return len(self._items) < self._capacity

    def push(self, item: T, *, terminal: bool = False) -> None:
        """Appends without waking the consumer; the engine wakes all touched channels once a step."""
        if self.closed:
            return
        self._items.append(item)
        self.closed = terminal

    def wake(self) -> None:
        """Called on the event loop (via call_soon_threadsafe) after the engine pushed."""
        self._ready.set()

    # -- event loop --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    async def get(self) -> T:
        while True:
            if self._items:
                return self._items.popleft()
            self._ready.clear()
            if self._items:  # pushed between the check and the clear
                continue
            await self._ready.wait()

    async def get_all(self) -> list[T]:
        """Every item buffered now, in order (waiting for the first): a consumer that is behind takes
        several steps' tokens at once and writes them in one go. Popped one by one, as many as were
        there when it looked: the engine thread may append meanwhile, never pop."""
        while True:
            if self._items:
                items = self._items
                return [items.popleft() for _ in range(len(items))]
            self._ready.clear()
            if self._items:  # pushed between the check and the clear
                continue
            await self._ready.wait()

    def cancel(self) -> None:
        self.cancelled = True
