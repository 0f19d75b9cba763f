"""Polling with a deadline, for tests that wait on another thread or process."""

from __future__ import annotations

import time

import httpx


def wait_until(check, timeout: float, what: str, interval: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
