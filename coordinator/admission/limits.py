"""Per-key limits and budgets: concurrent streams, requests a minute, tokens a minute, and a token
budget per calendar period, as the keys file sets them for each key.

Owns: each key's counters against its limits (`auth.KeyLimits`, from its entry in the keys file): its counters
(token buckets for requests and tokens a minute, the streams it has open, the tokens used this
period), and the 429 a key over one of them gets: `rate_limited` or `budget_exceeded`, with a
`Retry-After` and OpenAI's `x-ratelimit-*` headers, which every other answer of a limited key carries
too (`headers`, `with_ratelimit_headers`). A key's own limit never refuses another key.
Must not: know requests or tenants (the gateway admits and charges), or read the clock itself.

Tokens (prompt + generated) are charged when a request ends, from its usage, so a request admitted
under a limit runs to its end and may take the key past it; the key's next request then waits for
the bucket (or the next period) to come back above zero. Requests a minute and streams are counted
at admission. The counters are this coordinator's: with several coordinators each one holds a key
to its limits on its own share of the key's traffic (one key's clients usually reach one of them, by
the kernel's spread of connections, and at most N x the limit in all). They live in memory: a
restart starts each key's minute and period afresh.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Message, Send

from coordinator.auth import Client, KeyLimits
from coordinator.errors import CoordinatorError
from protocol import reasons


def period_start(period: str, now: float) -> tuple[float, float]:
    """The UTC calendar period holding `now` (a Unix time): its start and its end."""
    t = time.gmtime(now)
    if period == "hour":
        start = now - (t.tm_min * 60 + t.tm_sec) - (now % 1)
        return start, start + 3600
    midnight = now - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec) - (now % 1)
    if period == "day":
        return midnight, midnight + 86400
    if period == "week":  # ISO weeks: from Monday
        start = midnight - t.tm_wday * 86400
        return start, start + 7 * 86400
    start = midnight - (t.tm_mday - 1) * 86400
    return start, start + _days_in_month(t.tm_year, t.tm_mon) * 86400


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


class _Bucket:
    """A token bucket of `size` refilled at `size` a minute; its level may go below zero (a charge
    after the fact), and then nothing is admitted until it is back above zero."""

    __slots__ = ("at", "level", "size")

    def __init__(self, size: int, now: float) -> None:
        self.size = size
        self.level = float(size)
        self.at = now

    def refill(self, now: float) -> float:
        self.level = min(float(self.size), self.level + (now - self.at) * self.size / 60.0)
        self.at = now
        return self.level

    def seconds_until(self, level: float) -> float:
        """Seconds until the level reaches `level` (0 when it is there)."""
        return max(0.0, (level - self.level) * 60.0 / self.size)


@dataclass(slots=True)
class _KeyState:
    requests: _Bucket | None
    tokens: _Bucket | None
    streams: int = 0
    used: int = 0  # tokens this period
    period_end: float = 0.0


class Limits:
    def __init__(self, clock: Callable[[], float]) -> None:
        """`clock`: wall time (Unix seconds), for the minute buckets and the calendar periods."""
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def admit(self, key_id: str, limits: KeyLimits) -> None:
        """Count one request of the key, or raise its 429 (nothing counted then)."""
        if not limits.any:
            return
        now = self._clock()
        state = self._state(key_id, limits, now)
        if limits.streams is not None and state.streams >= limits.streams:
            raise self._refused(reasons.RATE_LIMITED, f"this key has {state.streams} requests running, its limit",
                                1.0, limits, state)
        if state.requests is not None and state.requests.refill(now) < 1:
            raise self._refused(reasons.RATE_LIMITED, f"this key may send {limits.rpm} requests a minute",
                                state.requests.seconds_until(1), limits, state)
        if state.tokens is not None and state.tokens.refill(now) <= 0:
            raise self._refused(reasons.RATE_LIMITED, f"this key may use {limits.tpm} tokens a minute",
                                state.tokens.seconds_until(1), limits, state)
        if limits.budget is not None and state.used >= limits.budget:
            raise self._refused(reasons.BUDGET_EXCEEDED, f"this key has used its budget of {limits.budget} "
                                f"tokens this {limits.period}", state.period_end - now, limits, state)
        if state.requests is not None:
            state.requests.level -= 1
        state.streams += 1

    def finished(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        """An admitted request ended having used `tokens` (prompt + generated)."""
        state = self._keys.get(key_id)
        if state is None or not limits.any:
            return
        now = self._clock()
        state.streams = max(0, state.streams - 1)
        if state.tokens is not None:
            state.tokens.refill(now)
            state.tokens.level -= tokens
        self._roll(state, limits, now)
        state.used += tokens

    def headers(self, key_id: str, limits: KeyLimits) -> dict[str, str]:
        """The key's `x-ratelimit-*` headers now (its requests and tokens a minute, where it has those
        limits), for every answer it gets: OpenAI sends them on each, so a client paces itself before
        it is refused, not only on its 429."""
        if not limits.any:
            return {}
        now = self._clock()
        state = self._state(key_id, limits, now)
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        return _ratelimit_headers(limits, state)

    def _state(self, key_id: str, limits: KeyLimits, now: float) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState(
                _Bucket(limits.rpm, now) if limits.rpm is not None else None,
                _Bucket(limits.tpm, now) if limits.tpm is not None else None)
        self._roll(state, limits, now)
        return state

    @staticmethod
    def _roll(state: _KeyState, limits: KeyLimits, now: float) -> None:
        if limits.budget is not None and now >= state.period_end:
            state.used = 0
            state.period_end = period_start(limits.period, now)[1]

    def _refused(self, reason: str, message: str, wait: float, limits: KeyLimits,
                 state: _KeyState) -> CoordinatorError:
        return CoordinatorError(reason, message, retry_after=max(1, math.ceil(wait)),
                                headers=_ratelimit_headers(limits, state))


def _ratelimit_headers(limits: KeyLimits, state: _KeyState) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, limit, bucket in (("requests", limits.rpm, state.requests), ("tokens", limits.tpm, state.tokens)):
        if limit is None or bucket is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
        headers[f"x-ratelimit-reset-{kind}"] = f"{bucket.seconds_until(bucket.size):.3g}s"
    return headers


def with_ratelimit_headers(send: Send, limits: Limits, client: Client) -> Send:
    """`send`, its response's head carrying `client`'s `x-ratelimit-*` headers as they stand when the
    answer starts (after this request was counted in); a 429 keeps those it was refused with."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            held = list(message.get("headers", []))
            if not any(name.startswith(b"x-ratelimit-") for name, _ in held):
                added = [(name.encode(), value.encode()) for name, value in
                         limits.headers(client.key_id, client.limits).items()]
                message = {**message, "headers": held + added}
        await send(message)
    return sending
