"""Who sends what, and when: the request sequence and the two arrival processes.

Owns: the deterministic sequence of work items (prompt and sampling seed per request, from one seeded
RNG), Poisson arrival offsets, and the closed-loop (N users, each sends its next request when the
last one ends) and open-loop (requests start on the arrival schedule, whatever is still running)
drivers. Every driver stops by itself: at the end of its items or at its deadline.
Must not: know HTTP or measure anything (clients.py and stats.py do).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Tell me a short story about a lighthouse keeper and a gull.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
)

SEED_RANGE = 2**31 - 1  # fits every server's seed field (ours allows up to 2**32 - 2)


@dataclass(frozen=True, slots=True)
class WorkItem:
    index: int
    prompt: str
    seed: int  # the request's sampling seed
    system: str | None = None  # a chat's system message before the prompt (openai-chat only)


class Workload:
    """The same seed gives the same prompts and sampling seeds, in the same order, on every run."""

    def __init__(self, prompts: Sequence[str] = PROMPTS, *, seed: int = 0) -> None:
        if not prompts:
            raise ValueError("a workload needs at least one prompt")
        self.prompts = tuple(prompts)
        self.seed = seed

    def items(self, limit: int) -> Iterator[WorkItem]:
        rng = random.Random(self.seed)
        for index in range(limit):
            yield WorkItem(index, rng.choice(self.prompts), rng.randrange(SEED_RANGE))

    def arrivals(self, rate: float) -> Iterator[float]:
        """Poisson arrivals at `rate` requests/s: offsets in seconds from the start, increasing."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        rng = random.Random(self.seed + 0x5EED)  # its own stream: prompts don't depend on the mode
        offset = 0.0
        while True:
            offset += rng.expovariate(rate)
            yield offset


Send = Callable[[WorkItem], Coroutine[Any, Any, None]]


async def closed_loop(send: Send, items: Iterator[WorkItem], users: int, *, stop_at: float | None,
                      clock: Callable[[], float]) -> None:
    """`users` loops, each sending its next item when its last one ended, until items or time run out.

    Requests still running at `stop_at` finish (each has its own timeout); none starts after it.
    """
    if users < 1:
        raise ValueError("users must be at least 1")

    async def user() -> None:
        while stop_at is None or clock() < stop_at:
            item = next(items, None)
            if item is None:
                return
            await send(item)

    await asyncio.gather(*(user() for _ in range(users)))


async def open_loop(send: Send, items: Iterator[WorkItem], offsets: Iterator[float], *,
                    duration: float | None, clock: Callable[[], float],
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Starts each item at its arrival offset, without waiting for earlier ones, until items run out
    or an offset passes `duration`; then waits for the requests still running."""
    start = clock()
    running: set[asyncio.Task[None]] = set()
    for item, offset in zip(items, offsets):
        if duration is not None and offset >= duration:
            break
        delay = start + offset - clock()
        if delay > 0:
            await sleep(delay)
        task = asyncio.create_task(send(item))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running)
