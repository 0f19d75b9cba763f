"""What one request measured: send time, the arrival time of each token event, the tokens, the outcome.

Owns: the measurements of a single request and the error key it is counted under.
Must not: do I/O or aggregate across requests (stats.py does).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum


class Failure(str, Enum):
    HTTP = "http"            # a non-200 answer before the first byte
    STREAM = "stream"        # an SSE `error` event after the stream started
    TIMEOUT = "timeout"      # the per-request deadline passed
    TRANSPORT = "transport"  # connection refused, reset, protocol violation on the wire
    PROTOCOL = "protocol"    # the stream ended without its final event, or an event did not parse


@dataclass
class RequestRecord:
    """Times are seconds from the moment the request was sent (the clock is the runner's)."""

    index: int
    sent_at: float = 0.0  # on the runner's clock, for ordering and the run's wall time
    event_times: list[float] = field(default_factory=list)  # one per token event (a chunk for OpenAI)
    e2e: float | None = None
    tokens: int = 0  # generated tokens: the final usage if the server sent it, else counted events
    token_mismatch: bool = False  # the final usage disagreed with what the token events said
    failure: Failure | None = None
    status: int | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None and self.e2e is not None

    @property
    def ttft(self) -> float | None:
        return self.event_times[0] if self.event_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1); None for one token."""
        if self.e2e is None or self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between successive token events (one event may carry several tokens)."""
        times = self.event_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def error_key(self) -> str:
        """The label this request's failure is counted under, e.g. `http 503 kv_full`."""
        if self.failure is None:
            return "" if self.ok else "protocol incomplete"
        if self.failure is Failure.HTTP:
            return f"http {self.status} {self.reason}".rstrip()
        return f"{self.failure.value} {self.reason}".rstrip()

    def fail(self, failure: Failure, reason: str = "", *, status: int | None = None) -> RequestRecord:
        self.failure, self.reason, self.status = failure, reason, status
        return self
