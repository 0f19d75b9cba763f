"""The retry policy: Retry-After honoured, backoff bounded, attempts and total wait bounded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from client.retry import RetryPolicy, parse_retry_after

POLICY = RetryPolicy(attempts=4, max_wait=10.0, base=0.5, cap=2.0, jitter=0.25)


@pytest.mark.parametrize(("tries", "waited", "retry_after", "rand", "expected"), [
    # Retry-After: at least the server's figure, at most a quarter more.
    (1, 0.0, 3.0, 0.0, 3.0),
    (1, 0.0, 3.0, 0.999, 3.0 * (1 + 0.25 * 0.999)),
    (1, 0.0, 0.0, 0.5, 0.0),
    # ...cut to what is left of the budget, but never below the server's figure.
    (2, 6.5, 3.0, 0.999, 3.5),
    (2, 7.5, 3.0, 0.0, None),  # 7.5 + 3 > 10: give up now rather than sleep and fail
    (1, 0.0, 60.0, 0.0, None),  # a Retry-After past the whole budget
    # No header: full jitter over base * 2^(tries-1), capped.
    (1, 0.0, None, 0.5, 0.25),
    (2, 0.0, None, 0.5, 0.5),
    (3, 0.0, None, 0.999, 0.999 * 2.0),
    (3, 9.5, None, 0.999, None),  # the jittered wait would pass the budget
    # Attempts: after the 4th try there is no 5th.
    (4, 0.0, 1.0, 0.0, None),
    (4, 0.0, None, 0.0, None),
])
def test_delay(tries: int, waited: float, retry_after: float | None, rand: float, expected: float | None) -> None:
    got = POLICY.delay(tries, waited, retry_after, lambda: rand)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_the_total_wait_of_a_job_never_passes_the_budget() -> None:
    # A server that always says Retry-After: 1.7 and a jitter at its largest.
    policy = RetryPolicy(attempts=100, max_wait=10.0)
    waited, tries = 0.0, 1
    while (delay := policy.delay(tries, waited, 1.7, lambda: 0.999)) is not None:
        assert delay >= 1.7
        waited += delay
        tries += 1
    assert 10.0 - 1.7 < waited <= 10.0


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"max_wait": -1.0}, {"base": 0.0}, {"base": 3.0, "cap": 2.0}])
def test_an_invalid_policy_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_parse_retry_after() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30), usegmt=True), now) == 30.0
    assert parse_retry_after(format_datetime(now - timedelta(seconds=30), usegmt=True), now) == 0.0
    for unreadable in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(unreadable) is None
