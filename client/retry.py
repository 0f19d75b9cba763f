"""When a refused request is tried again, and after how long.

Owns: which answers are worth another attempt, the backoff, and reading `Retry-After`.
Must not: sleep, send or read a clock; the caller passes in what it knows and a random source.

The coordinator answers 503 (capacity: `queue_full`, `queue_timeout`, `kv_full`, ...) with
`Retry-After` in seconds: the client waits at least that long, plus up to a quarter more so that a
batch refused all at once does not come back all at once. Without the header it backs off
exponentially with full jitter (`base`, doubling, capped at `cap`). Both are bounded: at most
`attempts` tries per job, and at most `max_wait` seconds of waiting per job in all; a wait that would
pass that budget ends the job at once, instead of sleeping first and failing after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# 502/504: the coordinator could not reach a worker before the first event; 429: any proxy in front.
RETRY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # tries per job, the first included
    max_wait: float = 120.0  # seconds of waiting between tries, per job, in all
    base: float = 0.5
    cap: float = 20.0
    jitter: float = 0.25  # extra fraction of Retry-After, at most

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_wait < 0 or self.base <= 0 or self.cap < self.base or self.jitter < 0:
            raise ValueError(f"invalid retry policy: {self}")

    def delay(self, tries: int, waited: float, retry_after: float | None,
              rand: Callable[[], float]) -> float | None:
        """Seconds to wait before try number `tries + 1`, having waited `waited` so far; None: give up.

        `rand` returns a float in [0, 1).
        """
        if tries >= self.attempts:
            return None
        if retry_after is not None:
            wait = retry_after * (1 + self.jitter * rand())
            if waited + retry_after > self.max_wait:
                return None  # even the server's minimum is past the budget
            return min(wait, self.max_wait - waited)
        wait = rand() * min(self.cap, self.base * 2 ** (tries - 1))
        return wait if waited + wait <= self.max_wait else None


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)
