"""Table-driven tests of the pure scheduler: filters, 60/40 scores, picker, affinity."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator import scheduler
from coordinator.demand import Demand
from protocol import reasons

NOW = 100.0
STALE = 3.0


@dataclass
class W:
    worker_id: str
    model: str = "m"
    last_seen: float = NOW
    sessions: int = 0
    max_sessions: int = 10
    kv_reserved_bytes: int = 0
    kv_capacity_bytes: int = 10_000
    bytes_per_token: int = 10
    session_max_tokens: int = 500
    draining: bool = False


SMALL = Demand(prompt_bytes=10, max_tokens=26)  # 100 tokens = 1,000 bytes at 10 bytes/token

CASES = [
    # (name, request, workers, expected ranking or reason)
    ("no workers", scheduler.Request(SMALL), [], reasons.NO_WORKERS),
    ("only stale", scheduler.Request(SMALL), [W("a", last_seen=NOW - 3.0)], reasons.NO_WORKERS),
    ("just fresh enough", scheduler.Request(SMALL), [W("a", last_seen=NOW - 2.99)], ["a"]),
    ("wrong model", scheduler.Request(SMALL, model="other"), [W("a")], reasons.MODEL_UNAVAILABLE),
    ("model filter", scheduler.Request(SMALL, model="x"), [W("a"), W("b", model="x")], ["b"]),
    ("any model when none asked", scheduler.Request(SMALL), [W("a", model="y"), W("b", model="x")], ["a", "b"]),
    ("draining", scheduler.Request(SMALL), [W("a", draining=True)], reasons.DRAINING),
    ("sessions full", scheduler.Request(SMALL), [W("a", sessions=10)], reasons.SESSIONS_FULL),
    ("continuing needs no seat", scheduler.Request(Demand(10, 26, new_session=False), session_id="s",
                                                   session_worker="a"), [W("a", sessions=10)], ["a"]),
    ("kv full", scheduler.Request(SMALL), [W("a", kv_reserved_bytes=9_001)], reasons.KV_FULL),
    ("kv exactly enough", scheduler.Request(SMALL), [W("a", kv_reserved_bytes=9_000)], ["a"]),
    ("kv need capped by session max", scheduler.Request(Demand(10_000, 26)),
     [W("a", kv_reserved_bytes=5_000)], ["a"]),
    ("sessions weigh 0.6", scheduler.Request(SMALL),
     [W("a", sessions=5), W("b", kv_reserved_bytes=5_000)], ["b", "a"]),  # 0.30 vs 0.20
    ("kv weighs 0.4", scheduler.Request(SMALL),
     [W("a", sessions=3), W("b", kv_reserved_bytes=5_000)], ["a", "b"]),  # 0.18 vs 0.20
    ("ties by id", scheduler.Request(SMALL), [W("b"), W("a")], ["a", "b"]),
    ("affinity wins over load", scheduler.Request(SMALL, session_id="s", session_worker="busy"),
     [W("idle"), W("busy", sessions=9, kv_reserved_bytes=8_000)], ["busy"]),
    ("affinity worker stale", scheduler.Request(SMALL, session_id="s", session_worker="a"),
     [W("a", last_seen=NOW - 10), W("b")], reasons.UNKNOWN_SESSION),
    ("affinity worker gone", scheduler.Request(SMALL, session_id="s", session_worker="gone"),
     [W("b")], reasons.UNKNOWN_SESSION),
]


@pytest.mark.parametrize(("name", "request_", "workers", "expected"), CASES, ids=[c[0] for c in CASES])
def test_select(name: str, request_: scheduler.Request, workers: list[W], expected: object) -> None:
    decision = scheduler.select(request_, workers, now=NOW, stale_after=STALE)
    if isinstance(expected, str):
        assert decision.reason == expected
        assert decision.ranked == ()
    else:
        assert decision.reason is None
        assert [w.worker_id for w in decision.ranked] == expected


@pytest.mark.parametrize(("sessions", "kv", "expected"), [
    (0, 0, 0.0), (10, 0, 0.6), (0, 10_000, 0.4), (5, 5_000, 0.5), (20, 20_000, 1.0),
])
def test_score_is_60_40_of_capacity_fractions(sessions: int, kv: int, expected: float) -> None:
    assert scheduler.score(W("a", sessions=sessions, kv_reserved_bytes=kv)) == pytest.approx(expected)


def test_select_does_not_touch_workers() -> None:
    workers = [W("a", sessions=1), W("b")]
    before = [vars(w).copy() for w in workers]
    scheduler.select(scheduler.Request(SMALL), workers, now=NOW, stale_after=STALE)
    assert [vars(w) for w in workers] == before
