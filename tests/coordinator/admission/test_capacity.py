"""Admission: the O(1) check's reasons, and reservations that always return to zero."""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING

import pytest

from coordinator.admission.capacity import Admission
from coordinator.admission.demand import TEMPLATE_TOKENS, Demand
from coordinator.admission.fairness import FairShares
from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import ENDED, Registry, WorkerRecord
from protocol import reasons
from protocol.health import TenantUse
from tests.coordinator.fakes import heartbeat

if TYPE_CHECKING:
    from _typeshed import TraceFunction


def setup(*beats: dict) -> tuple[Registry, Admission, ManualClock]:  # type: ignore[type-arg]
    clock = ManualClock()
    reg = Registry(stale_after=3.0, dead_after=6.0)
    for i, over in enumerate(beats):
        reg.upsert(heartbeat(f"w{i}", timestamp=clock.time(), **over), now=clock.monotonic())
    return reg, Admission(reg, clock, retry_after=2), clock


def reason_of(adm: Admission, demand: Demand, model: str | None = None) -> str | None:
    try:
        adm.check(demand, model)
    except CoordinatorError as exc:
        return exc.reason
    return None


SMALL = Demand(prompt_bytes=10, max_tokens=100)
URGENT = Demand(prompt_bytes=10, max_tokens=100, preempts=True)


@pytest.mark.parametrize(("beats", "demand", "model", "expected"), [
    ([], SMALL, None, reasons.NO_WORKERS),
    ([{}], SMALL, None, None),
    ([{}], SMALL, "smol", None),
    ([{}], SMALL, "other", reasons.UNKNOWN_MODEL),
    ([{"sessions": 4}], SMALL, None, reasons.SESSIONS_FULL),
    ([{"sessions": 4}], Demand(10, 100, new_session=False), None, None),
    ([{"sessions": 4}, {}], SMALL, None, None),
    ([{"kv_reserved_bytes": 1_000_000 - 17_399}], SMALL, None, reasons.KV_FULL),  # needs 174 x 100
    ([{"kv_reserved_bytes": 1_000_000 - 17_400}], SMALL, None, None),
    # The estimate never exceeds one session's limit (2,000 tokens here).
    ([{"kv_reserved_bytes": 800_000}], Demand(900_000, 100), None, None),
    ([{"kv_reserved_bytes": 800_001}], Demand(900_000, 100), None, reasons.KV_FULL),
    # Several choices: a sequence and a prompt's copy each (the default worker: 4 sequences, none used).
    ([{"sessions": 1}], Demand(10, 100, choices=3), None, None),
    ([{"sessions": 2}], Demand(10, 100, choices=3), None, reasons.SESSIONS_FULL),
    ([{"kv_reserved_bytes": 1_000_000 - 3 * 17_400}], Demand(10, 100, choices=3), None, None),
    ([{"kv_reserved_bytes": 1_000_000 - 3 * 17_400 + 1}], Demand(10, 100, choices=3), None, reasons.KV_FULL),
    # An interactive request passes a full pool where a worker can park a batch request; nothing else does.
    ([{"sessions": 4, "parkable": 1}], URGENT, None, None),
    ([{"sessions": 4, "kv_reserved_bytes": 1_000_000, "parkable": 1}], URGENT, None, None),
    ([{"sessions": 4, "parkable": 1}], SMALL, None, reasons.SESSIONS_FULL),
    ([{"sessions": 4}], URGENT, None, reasons.SESSIONS_FULL),
    ([{"sessions": 4, "parkable": 1}], Demand(10, 100, choices=2, preempts=True), None, reasons.SESSIONS_FULL),
])
def test_check(beats: list[dict], demand: Demand, model: str | None, expected: str | None) -> None:  # type: ignore[type-arg]
    _, adm, _ = setup(*beats)
    assert reason_of(adm, demand, model) == expected


def test_overloaded_carries_retry_after_and_unknown_model_does_not() -> None:
    _, adm, _ = setup({"sessions": 4})
    with pytest.raises(CoordinatorError) as full:
        adm.check(SMALL, None)
    assert (full.value.status, full.value.retry_after) == (503, 2)
    with pytest.raises(CoordinatorError) as unknown:
        adm.check(SMALL, "nope")
    assert (unknown.value.status, unknown.value.retry_after) == (404, None)


def test_stale_model_is_unavailable_not_unknown() -> None:
    reg, adm, clock = setup({"model": "x"}, {"model": "y"})
    clock.advance(2.0)
    reg.upsert(heartbeat("w1", timestamp=clock.time(), model="y"), now=clock.monotonic())
    clock.advance(1.5)  # w0 (model x) is stale now, w1 is not
    assert reason_of(adm, SMALL, "x") == reasons.MODEL_UNAVAILABLE


def test_reservations_fill_capacity_then_release_to_zero() -> None:
    reg, adm, _clock = setup({"max_sessions": 2})
    worker = reg.get("w0")
    assert worker is not None
    first, second = adm.reserve(worker, SMALL), adm.reserve(worker, SMALL)
    assert reason_of(adm, SMALL) == reasons.SESSIONS_FULL
    adm.confirm(first, prompt_tokens=20)
    assert first.kv_bytes == (20 + 100) * 100 and second.kv_bytes == (10 + TEMPLATE_TOKENS + 100) * 100
    assert adm.in_flight == 2 and adm.in_flight_kv_bytes == first.kv_bytes + second.kv_bytes
    adm.release(first)
    adm.release(first)  # idempotent
    adm.release(second)
    assert adm.in_flight == 0 and adm.in_flight_kv_bytes == 0
    assert worker.kv_reserved_bytes == 0 and worker.sessions == 0
    # Kept until a heartbeat shows the worker no longer counts them (none ever did here).
    assert {c.state for c in worker.corrections.values()} == {ENDED}
    assert reason_of(adm, SMALL) is None


def test_release_after_a_heartbeat_counted_it_frees_until_the_next_heartbeat() -> None:
    reg, adm, clock = setup({"max_sessions": 1})
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, SMALL)
    adm.confirm(res, prompt_tokens=10)
    clock.advance(0.5)  # the worker's next heartbeat includes the stream
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=1, sessions=1, kv_reserved_bytes=11_000,
                         streams=[res.key]), now=clock.monotonic())
    assert worker.sessions == 1 and worker.kv_reserved_bytes == 11_000
    assert reason_of(adm, SMALL) == reasons.SESSIONS_FULL
    adm.release(res)  # stream ended: admits at once, before the next heartbeat
    assert worker.sessions == 0 and worker.kv_reserved_bytes == 0
    assert reason_of(adm, SMALL) is None
    clock.advance(1.0)
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=1), now=clock.monotonic())
    assert worker.sessions == 0 and worker.corrections == {}


def steps_of_a_rejection(workers: int) -> int:
    """The interpreter steps (calls, lines, returns) `check` takes to reject with `workers` full workers."""
    _, adm, _ = setup(*[{"sessions": 4}] * workers)
    steps = 0

    def count(frame: FrameType, event: str, arg: object) -> TraceFunction:
        nonlocal steps
        steps += 1
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        reason = reason_of(adm, SMALL)
    finally:
        sys.settrace(previous)
    assert reason == reasons.SESSIONS_FULL
    return steps


def test_rejection_cost_does_not_grow_with_workers() -> None:
    """O(1): the check reads sums, so it never iterates the registry. Counted in interpreter steps, not
    seconds, so it cannot flake: a loop over workers written in Python (a `for`, a comprehension, a
    generator, a property read per record) adds steps per worker whichever container it walks:
    `alive()`, `all()` or the registry's own dicts (scripts/mutations.py breaks it each of those ways)."""
    assert steps_of_a_rejection(10_000) == steps_of_a_rejection(10)


def test_a_kept_session_keeps_counting_until_a_heartbeat_shows_it() -> None:
    reg, adm, clock = setup({"max_sessions": 2})
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, SMALL)
    adm.confirm(res, prompt_tokens=10)
    adm.release(res, kept_tokens=30)  # ended before any heartbeat; its session stays on the worker
    assert (worker.sessions, worker.kv_reserved_bytes) == (1, 3_000)
    assert adm.in_flight == 0 and adm.in_flight_kv_bytes == 0
    clock.advance(0.5)
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=2, sessions=1, kv_used_bytes=3_000,
                         kv_reserved_bytes=3_000), now=clock.monotonic())
    assert (worker.sessions, worker.kv_reserved_bytes, worker.corrections) == (1, 3_000, {})


def test_a_reservation_grows_to_the_workers_exact_count_when_the_template_adds_more() -> None:
    reg, adm, _ = setup({})
    worker = reg.get("w0")
    assert worker is not None
    demand = Demand(prompt_bytes=10, max_tokens=5)
    res = adm.reserve(worker, demand)
    estimate = res.kv_bytes
    assert estimate == (10 + TEMPLATE_TOKENS + 5) * worker.bytes_per_token
    adm.confirm(res, prompt_tokens=10 + TEMPLATE_TOKENS + 100)  # a template 100 tokens longer than allowed for
    assert res.kv_bytes == (10 + TEMPLATE_TOKENS + 105) * worker.bytes_per_token > estimate
    assert adm.in_flight_kv_bytes == res.kv_bytes and worker.kv_reserved_bytes == res.kv_bytes
    adm.confirm(res, prompt_tokens=3)  # and it follows the exact count down as well
    assert res.kv_bytes == 8 * worker.bytes_per_token
    adm.release(res)
    assert adm.in_flight_kv_bytes == 0 and worker.kv_reserved_bytes == 0


def test_a_release_tells_who_waits_for_that_model() -> None:
    reg, _, clock = setup({"model": "x"})
    released: list[str] = []
    adm = Admission(reg, clock, retry_after=2, on_release=released.append)
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, SMALL)
    adm.release(res)
    adm.release(res)  # idempotent: told once
    assert released == ["x"]


def test_a_heartbeat_that_lists_the_stream_is_not_counted_twice() -> None:
    """Churn (issue 11): a heartbeat made between the worker's admission and the coordinator's
    confirmation counts the stream; the reservation's correction used to count it again until the
    next heartbeat. The heartbeat's list of stream references tells the two apart."""
    reg, adm, clock = setup({"max_sessions": 4})
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, SMALL)
    reg.upsert(heartbeat("w0", timestamp=clock.time() + 0.2, max_sessions=4, sessions=1, kv_reserved_bytes=11_000,
                         streams=[res.key]), now=clock.monotonic())
    assert worker.sessions == 1
    adm.confirm(res, prompt_tokens=10)
    assert worker.sessions == 1
    adm.release(res)
    assert worker.sessions == 0  # the report still lists it: taken off until one does not


def test_a_release_before_the_worker_answered_takes_off_what_a_later_heartbeat_lists() -> None:
    """The client left during the worker's admission: the coordinator never saw the worker's answer,
    yet the worker admitted the stream and a heartbeat counts it until the worker frees it."""
    reg, adm, clock = setup({"max_sessions": 4})
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, SMALL)
    adm.release(res)
    assert worker.sessions == 0
    clock.advance(0.1)
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=4, sessions=1, streams=[res.key]),
               now=clock.monotonic())
    assert worker.sessions == 0
    clock.advance(1.0)
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=4), now=clock.monotonic())
    assert worker.sessions == 0 and worker.corrections == {}


def test_stream_references_of_two_coordinators_do_not_meet() -> None:
    reg, first, clock = setup({})
    second = Admission(reg, clock, retry_after=2)
    worker = reg.get("w0")
    assert worker is not None
    assert first.reserve(worker, SMALL).key != second.reserve(worker, SMALL).key


def test_a_request_of_several_choices_reserves_for_each_and_gives_all_back() -> None:
    reg, adm, _ = setup({})
    worker = reg.get("w0")
    assert worker is not None
    res = adm.reserve(worker, Demand(prompt_bytes=10, max_tokens=5, choices=4))
    assert res.sessions == 4 and res.kv_bytes == 4 * (10 + TEMPLATE_TOKENS + 5) * worker.bytes_per_token
    assert (worker.sessions, worker.kv_reserved_bytes) == (4, res.kv_bytes)
    adm.confirm(res, prompt_tokens=20)  # the worker's exact count: the prompt in each choice's sequence
    assert res.kv_bytes == 4 * 25 * worker.bytes_per_token == worker.kv_reserved_bytes == adm.in_flight_kv_bytes
    adm.release(res)
    assert (worker.sessions, worker.kv_reserved_bytes, adm.in_flight_kv_bytes) == (0, 0, 0)


# -- headroom for other tenants (fair shares) -------------------------------------------------------------


def fair_worker() -> tuple[Admission, FairShares, WorkerRecord]:
    """One worker of 8 sequences, admission with fair shares, and heavy active."""
    clock = ManualClock()
    reg = Registry(stale_after=3.0, dead_after=6.0)
    reg.upsert(heartbeat("w0", timestamp=clock.time(), max_sessions=8), now=clock.monotonic())
    fair = FairShares()
    worker = reg.get("w0")
    assert worker is not None
    fair.arrive("heavy")
    return Admission(reg, clock, retry_after=2, fair=fair), fair, worker


def test_a_tenant_at_its_share_leaves_one_free_sequence_per_other_active_tenant() -> None:
    adm, fair, worker = fair_worker()
    held = [adm.reserve(worker, SMALL, "heavy") for _ in range(7)]  # alone, it may take every sequence
    adm.check(SMALL, worker.model, "heavy")
    fair.arrive("light")  # another tenant is active: heavy holds 7 of 8, its share is 4
    with pytest.raises(CoordinatorError, match="kept for other tenants") as kept:
        adm.check(SMALL, worker.model, "heavy")
    assert kept.value.reason == reasons.SESSIONS_FULL  # queueable: it waits for its turn
    adm.check(SMALL, worker.model, "light")  # the last free sequence is light's
    for res in held[:4]:
        adm.release(res)
    adm.check(SMALL, worker.model, "heavy")  # under its share again (3 of 8)
    fair.depart("light")
    for res in held[4:]:
        adm.release(res)
    assert adm._held == {}  # every reservation's count given back


def test_a_tenant_at_its_share_defers_to_one_below_it_waiting_at_any_coordinator() -> None:
    adm, fair, worker = fair_worker()
    held = [adm.reserve(worker, SMALL, "heavy") for _ in range(4)]  # its share of 8 with light active: 4
    light = [TenantUse(tenant="light", running=1)]  # light runs one, through another coordinator
    fair.beat("w0", worker.model, light)
    adm.check(SMALL, worker.model, "heavy")  # 3 free sequences: no one else waits for them
    fair.beat("w0", worker.model, light, waiting=["light"])  # another coordinator has light waiting
    with pytest.raises(CoordinatorError, match="kept for other tenants"):
        adm.check(SMALL, worker.model, "heavy")
    adm.check(SMALL, worker.model, "light")
    fair.beat("w0", worker.model, light, waiting=["heavy", "light"])
    adm.release(held.pop())  # heavy below its share: it defers to no one
    adm.check(SMALL, worker.model, "heavy")


def test_each_interactive_request_placed_over_a_full_worker_uses_up_one_batch_request_it_can_park() -> None:
    reg, adm, _clock = setup({"sessions": 4, "parkable": 2})
    worker = reg.get("w0")
    assert worker is not None and worker.preemptible == 2
    adm.reserve(worker, URGENT)
    assert worker.preemptible == 1 and reason_of(adm, URGENT) is None
    adm.reserve(worker, URGENT)
    assert worker.preemptible == 0 and reason_of(adm, URGENT) == reasons.SESSIONS_FULL
