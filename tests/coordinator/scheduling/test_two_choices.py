"""two-choices: the better of two random draws first, reproducible from the seed; added as one module
and this test (the catalog, the settings and --help know it with no other change)."""

from __future__ import annotations

import random
from collections import Counter

from coordinator.scheduling import Policy, Request
from coordinator.scheduling.pickers.two_choices import TwoChoices
from coordinator.settings import Settings
from tests.coordinator.scheduling.test_policy import NOW, SMALL, STALE, W


def test_the_less_loaded_of_the_two_drawn_goes_first_and_every_worker_follows() -> None:
    workers = [W(name, in_flight=n) for name, n in zip("abcd", (0, 5, 6, 7), strict=True)]
    firsts: Counter[str] = Counter()
    rng = random.Random(3)
    for _ in range(600):
        ranked = TwoChoices().rank(Request(SMALL, rng=rng), workers, {}, NOW)
        assert sorted(w.worker_id for w in ranked) == ["a", "b", "c", "d"]
        assert ranked[0].in_flight <= ranked[1].in_flight
        firsts[ranked[0].worker_id] += 1
    # a wins every draw it is in (half of the pairs), b the pairs without a but with b (two of six),
    # c the one pair of c and d; the most loaded worker is never first
    assert 250 < firsts["a"] < 350 and 150 < firsts["b"] < 250 and 60 < firsts["c"] < 140 and firsts["d"] == 0


def test_the_draw_is_reproducible_from_the_seed_and_two_workers_are_least_connections() -> None:
    workers = [W(name) for name in "abcde"]

    def firsts(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [TwoChoices().rank(Request(SMALL, rng=rng), workers, {}, NOW)[0].worker_id for _ in range(40)]

    assert firsts(1) == firsts(1) and firsts(1) != firsts(2)
    pair = [W("a", in_flight=2), W("b", in_flight=1)]
    assert [w.worker_id for w in TwoChoices().rank(Request(SMALL, rng=random.Random(0)), pair, {}, NOW)] == ["b", "a"]


def test_it_is_a_routing_policy_by_its_name() -> None:
    assert Settings(routing_policy="two-choices").routing_policy == "two-choices"
    assert Policy.build(stale_after=STALE, routing="two-choices").picker == TwoChoices()
