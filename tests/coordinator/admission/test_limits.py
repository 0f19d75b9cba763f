"""Per-key limits on their own: requests and tokens a minute, streams at once, budgets per calendar
period; the 429's reason, Retry-After and x-ratelimit-* headers; the keys file's options."""

from __future__ import annotations

import calendar

import pytest

from coordinator.admission.limits import Limits, period_start
from coordinator.auth import ApiKeys, KeyLimits
from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError, error_headers
from protocol import reasons


def refusal(limits: Limits, key: str, of: KeyLimits) -> CoordinatorError:
    with pytest.raises(CoordinatorError) as refused:
        limits.admit(key, of)
    return refused.value


def test_requests_a_minute_refill_over_the_minute_and_say_when() -> None:
    clock, rpm = ManualClock(), KeyLimits(rpm=3)
    limits = Limits(clock.time)
    for _ in range(3):
        limits.admit("k", rpm)
        limits.finished("k", rpm, 10)
    refused = refusal(limits, "k", rpm)
    assert (refused.status, refused.reason, refused.retry_after) == (429, reasons.RATE_LIMITED, 20)
    headers = error_headers(refused, "r1")
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["retry-after"] == "20" and headers["x-ratelimit-reset-requests"] == "60s"
    limits.admit("other", rpm)  # a key's limit is its own
    clock.advance(19.9)
    refusal(limits, "k", rpm)
    clock.advance(0.2)
    limits.admit("k", rpm)


def test_streams_at_once() -> None:
    clock, two = ManualClock(), KeyLimits(streams=2)
    limits = Limits(clock.time)
    limits.admit("k", two)
    limits.admit("k", two)
    assert refusal(limits, "k", two).reason == reasons.RATE_LIMITED
    limits.finished("k", two, 0)
    limits.admit("k", two)


def test_tokens_are_charged_when_a_request_ends_and_a_debt_is_waited_out() -> None:
    clock, tpm = ManualClock(), KeyLimits(tpm=100)
    limits = Limits(clock.time)
    limits.admit("k", tpm)
    limits.admit("k", tpm)  # admitted under the limit: both run to their end
    limits.finished("k", tpm, 90)
    limits.finished("k", tpm, 60)  # 50 over
    refused = refusal(limits, "k", tpm)
    # Back above zero after 50 tokens' refill (30 s at 100 a minute), plus one token's worth.
    assert refused.reason == reasons.RATE_LIMITED and refused.retry_after == 31
    clock.advance(31)
    limits.admit("k", tpm)


def test_a_budget_lasts_its_calendar_period_then_starts_again() -> None:
    wall = calendar.timegm((2026, 11, 27, 22, 0, 0))  # 2 hours before midnight, UTC
    clock, budget = ManualClock(wall=wall), KeyLimits(budget=100, period="day")
    limits = Limits(clock.time)
    limits.admit("k", budget)
    limits.finished("k", budget, 100)
    refused = refusal(limits, "k", budget)
    assert (refused.status, refused.reason, refused.retry_after) == (429, reasons.BUDGET_EXCEEDED, 7200)
    clock.advance(7200)
    limits.admit("k", budget)


@pytest.mark.parametrize(("period", "start", "end"), [
    ("hour", (2026, 11, 27, 13, 0, 0), (2026, 11, 27, 14, 0, 0)),
    ("day", (2026, 11, 27, 0, 0, 0), (2026, 11, 28, 0, 0, 0)),
    ("week", (2026, 11, 23, 0, 0, 0), (2026, 11, 30, 0, 0, 0)),  # Monday to Monday
    ("month", (2026, 11, 1, 0, 0, 0), (2026, 12, 1, 0, 0, 0)),
])
def test_periods_are_utc_calendar_periods(period: str, start: tuple[int, ...], end: tuple[int, ...]) -> None:
    now = calendar.timegm((2026, 11, 27, 13, 45, 12)) + 0.5
    assert period_start(period, now) == (calendar.timegm(start), calendar.timegm(end))


def test_february_of_a_leap_year_has_29_days() -> None:
    start, end = period_start("month", calendar.timegm((2028, 2, 10, 0, 0, 0)))
    assert (end - start) / 86400 == 29


def test_a_keys_limits_come_from_its_entry() -> None:
    keys = ApiKeys(["heavy-key heavy 1 rpm=60 tpm=20000 streams=4 budget=1000000/week", "light-key light"])
    heavy, light = keys.identify({"x-api-key": "heavy-key"}), keys.identify({"x-api-key": "light-key"})
    assert heavy is not None and light is not None
    assert heavy.limits == KeyLimits(streams=4, rpm=60, tpm=20000, budget=1_000_000, period="week")
    assert light.limits == KeyLimits() and not light.limits.any


@pytest.mark.parametrize("option", ["rpm=0", "rpm=-1", "rpm=x", "tpm=", "speed=3", "budget=10/year", "rpm=1 rpm=2"])
def test_a_malformed_limit_is_refused_at_start_naming_its_line(tmp_path, option: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    path.write_text(f"good-key\nbad-key bad 1 {option}\n")
    with pytest.raises(ValueError, match="keys line 2: "):
        ApiKeys.from_setting(str(path))
