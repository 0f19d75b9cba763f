"""A uvicorn server that drains before it shuts down.

Owns: turning the first SIGTERM or Ctrl+C into the service's own drain, run while the server still
answers, and exiting 0 afterwards. Must not: know what draining means for a service (the coordinator's
drain.py and the worker's runtime do).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    """The first SIGTERM or SIGINT runs `drain` while the server keeps answering (503 `draining`, so
    clients and load balancers learn it), then shuts down as uvicorn does; the process exits 0, as a
    planned shutdown should. A second SIGINT exits at once, as uvicorn's second Ctrl+C does."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        if self._draining is not None:
            # A terminal's Ctrl+C reaches the whole process group and a supervisor (start.sh) then
            # sends SIGTERM too: that is the same request to stop, not an order to hurry. Only a
            # second Ctrl+C skips the drain.
            if sig == signal.SIGINT:
                self.force_exit = True
                super().handle_exit(sig, frame)
            return
        # Not recorded as captured: uvicorn would raise it again after shutdown and exit by the signal.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._draining is None:
            self.before_drain()
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    def before_drain(self) -> None:
        """What a service does the moment its drain starts, before `drain` runs (nothing here)."""

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
