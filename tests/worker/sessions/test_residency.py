"""worker/sessions/residency.py: the operator's keep-alive, which tenants' requests only lengthen, each its
own stay, within the operator's bound (issue 50: one tenant's `keep_alive: 0` unloaded the model another
was using, and its `-1` pinned it)."""

from __future__ import annotations

import pytest

from worker.sessions.residency import Residency

pytestmark = pytest.mark.unit


def test_a_tenants_zero_never_shortens_the_operators_keep_alive_or_another_tenants_stay() -> None:
    residency = Residency(base=60, bound=600)
    assert residency.idle_allowed(used_at=0, now=0) == 60
    residency.ask("t:b", 300, now=0)  # b asks the model to stay 5 minutes after its use
    residency.ask("t:a", 0, now=10)  # a asks it gone at once
    residency.used("t:a", now=10)
    assert residency.idle_allowed(used_at=10, now=10) == 290  # b's stay holds: until 300
    residency.ask("t:a", 20, now=10)  # a shorter stay of a's own, still running: b's holds
    assert residency.idle_allowed(used_at=10, now=10) == 290
    residency.ask("t:b", 0, now=20)  # b withdraws its own stay; the operator's 60 s still hold
    residency.used("t:b", now=20)
    assert residency.idle_allowed(used_at=20, now=20) == 60


def test_a_stay_counts_from_the_tenants_last_use_and_is_bounded_by_the_operator() -> None:
    residency = Residency(base=1, bound=100)
    residency.ask("t:a", 10_000, now=0)
    assert residency.granted(10_000) == 100
    residency.used("t:a", now=50)  # its request ran 50 s
    assert residency.idle_allowed(used_at=50, now=50) == 100
    assert residency.idle_allowed(used_at=50, now=151) == 1  # run out: forgotten, the operator's second left


def test_a_negative_keep_alive_pins_only_where_the_operator_allows() -> None:
    bounded = Residency(base=5, bound=30)
    bounded.ask("t:a", -1, now=0)
    assert bounded.idle_allowed(used_at=0, now=0) == 30
    unbounded = Residency(base=5, bound=-1)
    unbounded.ask("t:a", -1, now=0)
    assert unbounded.idle_allowed(used_at=0, now=1e9) is None
    unbounded.ask("t:a", 0, now=1)  # the same tenant takes its pin back
    assert unbounded.idle_allowed(used_at=1, now=1) == 5


def test_no_keep_alive_set_by_the_operator_is_never_unloaded_whatever_a_request_asks() -> None:
    residency = Residency(base=0, bound=600)
    residency.ask("t:a", 0, now=0)
    assert residency.idle_allowed(used_at=0, now=1e6) is None
