"""Admission of embedding requests: the O(1) check's reasons, and slots that always return to zero."""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from coordinator.admission.embeddings import EmbeddingAdmission, EmbeddingSlot
from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Registry
from protocol import reasons
from tests.coordinator.fakes import embedding_service, heartbeat

if TYPE_CHECKING:
    from _typeshed import TraceFunction


def setup(*beats: dict[str, Any], woken: list[str] | None = None) -> tuple[Registry, EmbeddingAdmission]:
    clock = ManualClock()
    reg = Registry(stale_after=3.0, dead_after=6.0)
    for i, over in enumerate(beats):
        reg.upsert(heartbeat(f"w{i}", timestamp=clock.time(), **over), now=clock.monotonic())
    on_release = woken.append if woken is not None else None
    return reg, EmbeddingAdmission(reg, clock, retry_after=2, on_release=on_release)


def reason_of(adm: EmbeddingAdmission, model: str | None = "smol") -> str | None:
    try:
        adm.check(model)
    except CoordinatorError as exc:
        return exc.reason
    return None


TWO = {"embeddings": embedding_service(capacity=2)}


@pytest.mark.parametrize(("beats", "model", "expected"), [
    ([], "smol", reasons.NO_WORKERS),
    ([TWO], "smol", None),
    ([TWO], "other", reasons.UNKNOWN_MODEL),
    ([{}], "smol", reasons.EMBEDDINGS_UNSUPPORTED),
    ([{}, TWO], "smol", None),
    ([{"model": "gen"}, {**TWO, "model": "emb"}], "gen", reasons.EMBEDDINGS_UNSUPPORTED),  # per model
    # Sequences and KV belong to generation: a worker full of them still embeds.
    ([{**TWO, "sessions": 4, "kv_reserved_bytes": 1_000_000}], "smol", None),
])
def test_check(beats: list[dict[str, Any]], model: str, expected: str | None) -> None:
    _, adm = setup(*beats)
    assert reason_of(adm, model) == expected


def test_slots_fill_then_free_and_each_release_wakes_the_models_queue() -> None:
    woken: list[str] = []
    reg, adm = setup(TWO, {**TWO, "model": "other"}, woken=woken)
    worker = reg.get("w0")
    assert worker is not None
    slots = [adm.reserve(worker), adm.reserve(worker)]
    assert reason_of(adm) == reasons.EMBEDDINGS_FULL and reason_of(adm, "other") is None
    assert (worker.in_flight, worker.embedding_requests, adm.in_flight) == (2, 2, 2)
    adm.release(slots[0])
    adm.release(slots[0])  # idempotent: every ending may call it
    assert reason_of(adm) is None and woken == ["smol"]
    adm.release(slots[1])
    assert (worker.in_flight, worker.embedding_requests, adm.in_flight) == (0, 0, 0)
    totals = reg.totals("smol")
    assert totals is not None and totals.free_embedding_slots == 2


def test_held_slots_outlive_heartbeats_and_sums_match_a_recount() -> None:
    """The registry's embedding sums stay equal to a from-scratch count through random holds, releases
    and heartbeats that change a worker's capacity or take its embeddings away."""
    rng = random.Random(3)
    reg, adm = setup(TWO, TWO, {}, TWO)
    clock_now = 0.0
    held: list[EmbeddingSlot] = []
    for _ in range(3_000):
        action = rng.random()
        if action < 0.4:
            worker = reg.get(f"w{rng.randrange(4)}")
            if worker is not None:
                held.append(adm.reserve(worker))
        elif action < 0.8 and held:
            adm.release(held.pop(rng.randrange(len(held))))
        else:
            clock_now += 0.1
            service = rng.choice([None, embedding_service(capacity=1), embedding_service(capacity=3)])
            reg.upsert(heartbeat(f"w{rng.randrange(4)}", timestamp=clock_now, embeddings=service), now=clock_now)
        alive = [w for w in reg.all() if w.state == "alive"]
        totals = reg.totals("smol")
        assert totals is not None
        assert totals.embedding_workers == sum(1 for w in alive if w.embeddings is not None)
        assert totals.free_embedding_slots == sum(max(0, w.embedding_capacity - w.embedding_requests) for w in alive)
    for slot in held:
        adm.release(slot)
    assert adm.in_flight == 0 and all(w.embedding_requests == 0 for w in reg.all())


def steps_of_a_check(workers: int) -> int:
    _, adm = setup(*[{"embeddings": embedding_service(capacity=1)}] * workers)
    for worker_id in (f"w{i}" for i in range(workers)):  # every slot taken: the check refuses
        record = adm._registry.get(worker_id)
        assert record is not None
        adm.reserve(record)
    steps = 0

    def count(frame: FrameType, event: str, arg: object) -> TraceFunction:
        nonlocal steps
        steps += 1
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        reason = reason_of(adm)
    finally:
        sys.settrace(previous)
    assert reason == reasons.EMBEDDINGS_FULL
    return steps


def test_the_check_costs_the_same_with_10_or_2000_workers() -> None:
    """O(1), counted in interpreter steps as generation's check is (test_capacity.py)."""
    assert steps_of_a_check(2_000) == steps_of_a_check(10)
