"""Each filter and scorer on its own, table-driven: one row per case that could go wrong."""

from __future__ import annotations

import pytest

from coordinator.admission.demand import Demand
from coordinator.scheduling import Request
from coordinator.scheduling.filters.alive import Alive
from coordinator.scheduling.filters.breaker_closed import BreakerClosed
from coordinator.scheduling.filters.embedding_room import EmbeddingRoom
from coordinator.scheduling.filters.kv_room import KvRoom
from coordinator.scheduling.filters.not_draining import NotDraining
from coordinator.scheduling.filters.serves_embeddings import ServesEmbeddings
from coordinator.scheduling.filters.serves_model import ServesModel
from coordinator.scheduling.filters.session_room import SessionRoom
from coordinator.scheduling.scorers.embedding_load import EmbeddingLoad
from coordinator.scheduling.scorers.kv_load import KvLoad
from coordinator.scheduling.scorers.prefix import Prefix
from coordinator.scheduling.scorers.session_load import SessionLoad
from tests.coordinator.scheduling.test_policy import NOW, SMALL, W

CONTINUING = Request(Demand(10, 26, new_session=False))
CHOICES = Demand(10, 26, choices=3)
URGENT = Request(Demand(10, 26, preempts=True))  # an interactive request: it may park a batch one
FILTERS = [
    (Alive(3.0), Request(SMALL), W("a", last_seen=NOW - 2.99), True),
    (Alive(3.0), Request(SMALL), W("a", last_seen=NOW - 3.0), False),
    (ServesModel(), Request(SMALL, model="m"), W("a"), True),
    (ServesModel(), Request(SMALL, model="x"), W("a"), False),
    (ServesModel(), Request(SMALL), W("a", model="anything"), True),
    (NotDraining(), Request(SMALL), W("a", draining=True), False),
    (NotDraining(), Request(SMALL), W("a"), True),
    (BreakerClosed(), Request(SMALL), W("a", breaker_open_until=NOW + 0.01), False),
    (BreakerClosed(), Request(SMALL), W("a", breaker_open_until=NOW), True),
    (BreakerClosed(), Request(SMALL), W("a", breaker_probing=True), False),
    (SessionRoom(), Request(SMALL), W("a", sessions=9), True),
    (SessionRoom(), Request(SMALL), W("a", sessions=10), False),
    (SessionRoom(), CONTINUING, W("a", sessions=10), True),
    (KvRoom(), Request(SMALL), W("a", kv_reserved_bytes=9_000), True),  # 100 tokens x 10 B free exactly
    (KvRoom(), Request(SMALL), W("a", kv_reserved_bytes=9_001), False),
    (KvRoom(), Request(Demand(10_000, 26)), W("a", kv_reserved_bytes=5_000), True),  # capped at 500 tokens
    # Several choices: a sequence each, and each its own copy of the prompt, all on one worker.
    (SessionRoom(), Request(CHOICES), W("a", sessions=7), True),
    (SessionRoom(), Request(CHOICES), W("a", sessions=8), False),
    (SessionRoom(), Request(CHOICES), W("a", sessions=10, idle_sessions=3), True),  # idle ones are evicted
    (KvRoom(), Request(CHOICES), W("a", kv_reserved_bytes=7_000), True),  # 3 x 100 tokens x 10 B free exactly
    (KvRoom(), Request(CHOICES), W("a", kv_reserved_bytes=7_001), False),
    (KvRoom(), Request(Demand(10_000, 26, choices=2)), W("a"), True),  # each capped at 500 tokens
    (KvRoom(), Request(Demand(10_000, 26, choices=2)), W("a", kv_reserved_bytes=1), False),
    # Parking: a full worker passes for an interactive request when it can park a batch one, never otherwise.
    (SessionRoom(), URGENT, W("a", sessions=10, preemptible=1), True),
    (SessionRoom(), URGENT, W("a", sessions=10), False),
    (SessionRoom(), Request(SMALL), W("a", sessions=10, preemptible=1), False),
    (SessionRoom(), Request(Demand(10, 26, choices=2, preempts=True)), W("a", sessions=10, preemptible=1), False),
    (KvRoom(), URGENT, W("a", kv_reserved_bytes=10_000, preemptible=1), True),
    (KvRoom(), URGENT, W("a", kv_reserved_bytes=10_000), False),
    (KvRoom(), Request(SMALL), W("a", kv_reserved_bytes=10_000, preemptible=1), False),
    (ServesEmbeddings(), Request(SMALL), W("a", embedding_capacity=1), True),
    (ServesEmbeddings(), Request(SMALL), W("a"), False),
    (EmbeddingRoom(), Request(SMALL), W("a", embedding_capacity=2, embedding_requests=1), True),
    (EmbeddingRoom(), Request(SMALL), W("a", embedding_capacity=2, embedding_requests=2), False),
    (EmbeddingRoom(), Request(SMALL), W("a"), False),
]


@pytest.mark.parametrize(("unit", "request_", "worker", "kept"), FILTERS,
                         ids=[f"{type(f[0]).__name__}-{i}" for i, f in enumerate(FILTERS)])
def test_filter(unit: object, request_: Request, worker: W, kept: bool) -> None:
    assert unit.keep(request_, worker, NOW) is kept  # type: ignore[attr-defined]


SCORES = [
    (SessionLoad(), W("a"), 0.0), (SessionLoad(), W("a", sessions=5), 0.5), (SessionLoad(), W("a", sessions=30), 1.0),
    (KvLoad(), W("a"), 0.0), (KvLoad(), W("a", kv_reserved_bytes=2_500), 0.25),
    (KvLoad(), W("a", kv_reserved_bytes=50_000), 1.0),
    (EmbeddingLoad(), W("a", embedding_capacity=4), 0.0),
    (EmbeddingLoad(), W("a", embedding_capacity=4, embedding_requests=1), 0.25),
    (EmbeddingLoad(), W("a", embedding_capacity=4, embedding_requests=9), 1.0),
    (EmbeddingLoad(), W("a"), 1.0),  # serves none: the worst
]


@pytest.mark.parametrize(("unit", "worker", "expected"), SCORES)
def test_scorer(unit: object, worker: W, expected: float) -> None:
    score = unit.score(Request(SMALL), worker)  # type: ignore[attr-defined]
    assert score == pytest.approx(expected) and 0.0 <= score <= 1.0


def test_prefix_scorer_is_the_share_not_sent_before() -> None:
    request = Request(SMALL, prefix_match={"a": 0.75})
    assert Prefix().score(request, W("a")) == 0.25 and Prefix().score(request, W("b")) == 1.0
