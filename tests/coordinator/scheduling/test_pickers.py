"""Each named routing policy's picker, table-driven over fake workers, and how a policy uses one."""

from __future__ import annotations

import random

import pytest

from coordinator.scheduling import Policy, Request
from coordinator.scheduling.pickers.least_connections import LeastConnections
from coordinator.scheduling.pickers.least_latency import LeastLatency
from coordinator.scheduling.pickers.random_pick import RandomPick
from coordinator.scheduling.pickers.round_robin import RoundRobin
from coordinator.scheduling.pickers.score import ByScore
from tests.coordinator.scheduling.test_policy import NOW, SMALL, STALE, W

A, B, C = W("a"), W("b"), W("c")


def ids(workers: list) -> list[str]:  # type: ignore[type-arg]
    return [w.worker_id for w in workers]


@pytest.mark.parametrize(("turn", "expected"), [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (2, ["c", "a", "b"]),
                                                 (3, ["a", "b", "c"]), (100, ["b", "c", "a"])])
def test_round_robin_starts_one_further_each_turn_whatever_the_input_order(turn: int, expected: list[str]) -> None:
    assert ids(RoundRobin().rank(Request(SMALL, turn=turn), [C, A, B], {}, NOW)) == expected


@pytest.mark.parametrize(("flights", "expected"), [
    ((0, 0, 0), ["a", "b", "c"]), ((3, 1, 2), ["b", "c", "a"]), ((1, 1, 0), ["c", "a", "b"]),
])
def test_least_connections_follows_the_coordinators_own_counts(flights: tuple[int, int, int],
                                                                expected: list[str]) -> None:
    workers = [W(name, in_flight=n) for name, n in zip("abc", flights, strict=True)]
    assert ids(LeastConnections().rank(Request(SMALL), workers, {}, NOW)) == expected


def test_random_is_reproducible_from_its_seed_and_uses_every_worker() -> None:
    def first(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [ids(RandomPick().rank(Request(SMALL, rng=rng), [C, A, B], {}, NOW))[0] for _ in range(60)]

    assert first(7) == first(7) and first(7) != first(8)
    assert set(first(7)) == {"a", "b", "c"}


@pytest.mark.parametrize(("workers", "expected"), [
    ([W("a", ttft_ewma=0.5, ttft_at=NOW), W("b", ttft_ewma=0.1, ttft_at=NOW)], ["b", "a"]),
    ([W("a", ttft_ewma=0.5, ttft_at=NOW), W("b")], ["b", "a"]),  # never measured: tried first
    # a's one slow sample halves every 10 idle seconds: after 30 s it is below b's fresh one
    ([W("a", ttft_ewma=0.8, ttft_at=NOW - 30), W("b", ttft_ewma=0.2, ttft_at=NOW)], ["a", "b"]),
    ([W("a", ttft_ewma=0.8, ttft_at=NOW - 10), W("b", ttft_ewma=0.2, ttft_at=NOW)], ["b", "a"]),
])
def test_least_latency_decays_while_idle(workers: list[W], expected: list[str]) -> None:
    assert ids(LeastLatency(half_life=10.0).rank(Request(SMALL), workers, {}, NOW)) == expected


@pytest.mark.parametrize(("workers", "expected"), [
    # a burst before any sample: spread by in-flight streams, not all onto the lower id
    ([W("a", in_flight=3), W("b", in_flight=2)], ["b", "a"]),
    # the faster worker, until its queue of streams outweighs its speed: 0.1 x 5 > 0.3 x 1
    ([W("a", ttft_ewma=0.1, ttft_at=NOW, in_flight=4), W("b", ttft_ewma=0.3, ttft_at=NOW)], ["b", "a"]),
    ([W("a", ttft_ewma=0.1, ttft_at=NOW, in_flight=1), W("b", ttft_ewma=0.3, ttft_at=NOW)], ["a", "b"]),
    # a busy worker's average does not decay: it is being measured
    ([W("a", ttft_ewma=0.8, ttft_at=NOW - 30, in_flight=1), W("b", ttft_ewma=0.5, ttft_at=NOW, in_flight=1)],
     ["b", "a"]),
])
def test_least_latency_weighs_streams_in_flight(workers: list[W], expected: list[str]) -> None:
    assert ids(LeastLatency(half_life=10.0).rank(Request(SMALL), workers, {}, NOW)) == expected


def test_score_orders_by_total_then_id() -> None:
    assert ids(ByScore().rank(Request(SMALL), [C, A, B], {"a": 0.5, "b": 0.1, "c": 0.1}, NOW)) == ["b", "c", "a"]


@pytest.mark.parametrize("routing", ["score", "round-robin", "least-connections", "random", "least-latency"])
def test_every_policy_passes_the_same_filters_and_affinity_still_wins(routing: str) -> None:
    policy = Policy.build(stale_after=STALE, routing=routing)
    workers = [W("a", sessions=10), W("b", draining=True), W("c", breaker_open_until=NOW + 5), W("d"), W("e")]
    chosen = ids(list(policy.select(Request(SMALL, rng=random.Random(1), turn=3), workers, now=NOW).ranked))
    assert sorted(chosen) == ["d", "e"]
    pinned = policy.select(Request(SMALL, session_id="s", session_worker="a"), workers, now=NOW)
    assert ids(list(pinned.ranked)) == ["a"]
    preferred = policy.select(Request(SMALL, prefer="e", rng=random.Random(1)), workers, now=NOW)
    assert ids(list(preferred.ranked))[0] == "e"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Policy.build(stale_after=STALE, routing="fastest")
