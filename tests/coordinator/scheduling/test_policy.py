"""Table-driven tests of the pure policy: filters in order, weighted scores, picker, affinity, preference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator.admission.demand import Demand
from coordinator.scheduling import Policy, Request
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
    idle_sessions: int = 0
    idle_kv_bytes: int = 0
    preemptible: int = 0
    kv_reserved_bytes: int = 0
    kv_capacity_bytes: int = 10_000
    bytes_per_token: int = 10
    session_max_tokens: int = 500
    draining: bool = False
    breaker_open_until: float = 0.0
    breaker_probing: bool = False
    in_flight: int = 0
    ttft_ewma: float | None = None
    ttft_at: float = 0.0
    picked_at: float = 0.0
    embedding_capacity: int = 0
    embedding_requests: int = 0


SMALL = Demand(prompt_bytes=10, max_tokens=26)  # 100 tokens = 1,000 bytes at 10 bytes/token
POLICY = Policy.build(stale_after=STALE)  # the default: 0.6 session load + 0.4 KV load

CASES = [
    # (name, request, workers, expected ranking or reason)
    ("no workers", Request(SMALL), [], reasons.NO_WORKERS),
    ("only stale", Request(SMALL), [W("a", last_seen=NOW - 3.0)], reasons.NO_WORKERS),
    ("just fresh enough", Request(SMALL), [W("a", last_seen=NOW - 2.99)], ["a"]),
    ("wrong model", Request(SMALL, model="other"), [W("a")], reasons.MODEL_UNAVAILABLE),
    ("model filter", Request(SMALL, model="x"), [W("a"), W("b", model="x")], ["b"]),
    ("any model when none asked", Request(SMALL), [W("a", model="y"), W("b", model="x")], ["a", "b"]),
    ("draining", Request(SMALL), [W("a", draining=True)], reasons.DRAINING),
    ("sessions full", Request(SMALL), [W("a", sessions=10)], reasons.SESSIONS_FULL),
    ("continuing needs no seat", Request(Demand(10, 26, new_session=False), session_id="s",
                                                   session_worker="a"), [W("a", sessions=10)], ["a"]),
    ("kv full", Request(SMALL), [W("a", kv_reserved_bytes=9_001)], reasons.KV_FULL),
    ("kv exactly enough", Request(SMALL), [W("a", kv_reserved_bytes=9_000)], ["a"]),
    ("kv need capped by session max", Request(Demand(10_000, 26)),
     [W("a", kv_reserved_bytes=5_000)], ["a"]),
    ("sessions weigh 0.6", Request(SMALL),
     [W("a", sessions=5), W("b", kv_reserved_bytes=5_000)], ["b", "a"]),  # 0.30 vs 0.20
    ("kv weighs 0.4", Request(SMALL),
     [W("a", sessions=3), W("b", kv_reserved_bytes=5_000)], ["a", "b"]),  # 0.18 vs 0.20
    ("ties by id", Request(SMALL), [W("b"), W("a")], ["a", "b"]),
    ("ties to the least recently picked", Request(SMALL), [W("a", picked_at=NOW - 1), W("b", picked_at=NOW - 5)],
     ["b", "a"]),
    ("affinity wins over load", Request(SMALL, session_id="s", session_worker="busy"),
     [W("idle"), W("busy", sessions=9, kv_reserved_bytes=8_000)], ["busy"]),
    ("affinity worker stale", Request(SMALL, session_id="s", session_worker="a"),
     [W("a", last_seen=NOW - 10), W("b")], reasons.UNKNOWN_SESSION),
    ("affinity worker gone", Request(SMALL, session_id="s", session_worker="gone"),
     [W("b")], reasons.UNKNOWN_SESSION),
    # Its worker restarted with another model: the session's KV is gone, and so is the model asked for.
    ("affinity worker serves another model now", Request(SMALL, model="m", session_id="s", session_worker="a"),
     [W("a", model="x"), W("b")], reasons.UNKNOWN_SESSION),
    ("affinity worker serves the model asked for", Request(SMALL, model="m", session_id="s", session_worker="a"),
     [W("a"), W("b")], ["a"]),
    ("breaker open", Request(SMALL), [W("a", breaker_open_until=NOW + 1)], reasons.WORKER_UNAVAILABLE),
    ("breaker cooled down: a probe may go", Request(SMALL), [W("a", breaker_open_until=NOW)], ["a"]),
    ("one probe at a time", Request(SMALL), [W("a", breaker_probing=True), W("b", sessions=9)], ["b"]),
    ("filters in order: the first limit that bites names it", Request(SMALL),
     [W("a", draining=True), W("b", sessions=10)], reasons.SESSIONS_FULL),
    ("a preferred worker goes first when eligible", Request(SMALL, prefer="b"),
     [W("a"), W("b", sessions=5)], ["b", "a"]),
    ("but not when it is filtered out", Request(SMALL, prefer="b"),
     [W("a"), W("b", sessions=10)], ["a"]),
]


@pytest.mark.parametrize(("name", "request_", "workers", "expected"), CASES, ids=[c[0] for c in CASES])
def test_select(name: str, request_: Request, workers: list[W], expected: object) -> None:
    decision = POLICY.select(request_, workers, now=NOW)
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
    total, parts = POLICY.score(Request(SMALL), W("a", sessions=sessions, kv_reserved_bytes=kv))
    assert total == pytest.approx(expected) and sum(parts.values()) == pytest.approx(total)
    assert set(parts) == {"session_load", "kv_load"}


def test_weights_come_from_the_settings_string() -> None:
    kv_only = Policy.build(stale_after=STALE, scorers="kv_load:1")
    busy_seats, busy_kv = W("a", sessions=9), W("b", kv_reserved_bytes=5_000)
    assert [w.worker_id for w in POLICY.select(Request(SMALL), [busy_seats, busy_kv], now=NOW).ranked] == ["b", "a"]
    assert [w.worker_id for w in kv_only.select(Request(SMALL), [busy_seats, busy_kv], now=NOW).ranked] == ["a", "b"]


@pytest.mark.parametrize(("spec", "problem"), [
    ("nope:1", "unknown scorer"), ("kv_load:x", "not a number"), ("kv_load:-1", "between"), ("", "at least one"),
])
def test_bad_scorer_settings_are_refused_with_the_reason(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Policy.build(stale_after=STALE, scorers=spec)


def test_select_does_not_touch_workers() -> None:
    workers = [W("a", sessions=1), W("b")]
    before = [vars(w).copy() for w in workers]
    POLICY.select(Request(SMALL), workers, now=NOW)
    assert [vars(w) for w in workers] == before


def test_a_prefix_wins_ties_of_load_but_balance_wins_past_the_threshold() -> None:
    policy = Policy.build(stale_after=STALE, scorers="session_load:0.6,kv_load:0.4,prefix:1", balance_threshold=0.3)
    cached = Request(SMALL, prefix_match={"b": 0.9})
    near = [W("a"), W("b", sessions=2)]  # b: load 0.12 above a, within the threshold: its prefix wins
    assert [w.worker_id for w in policy.select(cached, near, now=NOW).ranked] == ["b", "a"]
    far = [W("a"), W("b", sessions=6)]  # b: 0.36 above a: balance wins, b's prefix earns nothing
    decision = policy.select(cached, far, now=NOW)
    assert [w.worker_id for w in decision.ranked] == ["a", "b"]
    assert decision.parts["b"]["prefix"] == 1.0
    assert [w.worker_id for w in POLICY.select(cached, near, now=NOW).ranked] == ["a", "b"]  # 60/40 alone


EMBEDDINGS = Policy.build_embeddings(stale_after=STALE)
EMBED = Request(Demand(0, 0, new_session=False), model="m")
EMBEDDING_CASES = [
    ("only workers that embed", [W("a"), W("b", embedding_capacity=2)], ["b"]),
    ("none embeds", [W("a"), W("b")], reasons.EMBEDDINGS_UNSUPPORTED),
    ("every slot taken", [W("a", embedding_capacity=2, embedding_requests=2)], reasons.EMBEDDINGS_FULL),
    ("one slot left", [W("a", embedding_capacity=2, embedding_requests=1)], ["a"]),
    # Sequences and KV are the generation context's: a worker full of them still embeds.
    ("generation full does not matter", [W("a", embedding_capacity=1, sessions=10, kv_reserved_bytes=10_000)],
     ["a"]),
    ("the model still filters", [W("a", model="x", embedding_capacity=2)], reasons.MODEL_UNAVAILABLE),
    ("draining", [W("a", embedding_capacity=2, draining=True)], reasons.DRAINING),
    ("breaker open", [W("a", embedding_capacity=2, breaker_open_until=NOW + 1)], reasons.WORKER_UNAVAILABLE),
    ("stale", [W("a", embedding_capacity=2, last_seen=NOW - 3.0)], reasons.NO_WORKERS),
    ("the emptier embedding queue first", [W("a", embedding_capacity=4, embedding_requests=2),
                                           W("b", embedding_capacity=4, embedding_requests=1)], ["b", "a"]),
    ("and the idler decode loop", [W("a", embedding_capacity=4, sessions=8), W("b", embedding_capacity=4)],
     ["b", "a"]),
]


@pytest.mark.parametrize(("name", "workers", "expected"), EMBEDDING_CASES, ids=[c[0] for c in EMBEDDING_CASES])
def test_select_embeddings(name: str, workers: list[W], expected: object) -> None:
    decision = EMBEDDINGS.select(EMBED, workers, now=NOW)
    if isinstance(expected, str):
        assert decision.reason == expected and decision.ranked == ()
    else:
        assert decision.reason is None and [w.worker_id for w in decision.ranked] == expected


def test_the_embedding_policy_keeps_the_routing_policys_picker() -> None:
    embeddings = Policy.build_embeddings(stale_after=STALE, routing="round-robin")
    workers = [W("a", embedding_capacity=2), W("b", embedding_capacity=2)]
    firsts = {embeddings.select(Request(EMBED.demand, turn=turn), workers, now=NOW).ranked[0].worker_id
              for turn in range(2)}
    assert firsts == {"a", "b"}
