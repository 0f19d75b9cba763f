"""The stored Responses records a worker keeps (worker/sessions/records.py): per tenant, bounded in
count and bytes (the tenant's oldest first out), and in time."""

from __future__ import annotations

import pytest

from worker.sessions.records import Records, TooLarge


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(clock: Clock, *, per_tenant: int = 3, bytes_per_tenant: int = 100, ttl: float = 60.0) -> Records:
    return Records(per_tenant=per_tenant, bytes_per_tenant=bytes_per_tenant, ttl=ttl, clock=clock)


def test_a_record_is_its_tenants_only() -> None:
    kept = records(Clock())
    kept.put(("A", "resp_1"), b'{"a": 1}')
    found = kept.get(("A", "resp_1"))
    assert found is not None and found.body == b'{"a": 1}'
    assert kept.get(("B", "resp_1")) is None  # another tenant's id names nothing
    assert not kept.delete(("B", "resp_1")) and kept.get(("A", "resp_1")) is not None
    assert kept.delete(("A", "resp_1")) and kept.get(("A", "resp_1")) is None and len(kept) == 0


def test_past_the_count_the_tenants_oldest_goes_and_no_other_tenants() -> None:
    kept = records(Clock(), per_tenant=2)
    kept.put(("B", "b1"), b"x")
    for name in ("a1", "a2", "a3"):
        kept.put(("A", name), b"x")
    assert [kept.get(("A", n)) is not None for n in ("a1", "a2", "a3")] == [False, True, True]
    assert kept.get(("B", "b1")) is not None and kept.usage("A") == (2, 2)


def test_past_the_bytes_the_oldest_go_until_it_fits_and_one_too_large_is_refused() -> None:
    kept = records(Clock(), per_tenant=10, bytes_per_tenant=10)
    kept.put(("A", "a1"), b"1234")
    kept.put(("A", "a2"), b"1234")
    kept.put(("A", "a3"), b"123456")  # 14 > 10: a1 goes
    assert kept.get(("A", "a1")) is None and kept.usage("A") == (2, 10)
    with pytest.raises(TooLarge, match="WORKER_RESPONSES_BYTES_PER_TENANT"):
        kept.put(("A", "big"), b"x" * 11)
    assert kept.usage("A") == (2, 10)  # nothing lost to a refused one


def test_a_replaced_record_counts_once() -> None:
    kept = records(Clock(), bytes_per_tenant=10)
    kept.put(("A", "a1"), b"12345678")
    kept.put(("A", "a1"), b"123456789")
    assert kept.usage("A") == (1, 9)


def test_records_expire_after_their_ttl() -> None:
    clock = Clock()
    kept = records(clock, ttl=60.0)
    kept.put(("A", "old"), b"x")
    clock.now += 30
    kept.put(("A", "young"), b"x")
    clock.now += 31
    assert kept.get(("A", "old")) is None and kept.get(("A", "young")) is not None
    assert kept.sweep() == 1 and kept.usage("A") == (1, 1)


def test_a_handover_takes_the_oldest_first_within_its_bytes_and_forgets_them() -> None:
    kept = records(Clock(), per_tenant=10, bytes_per_tenant=100)
    for name in ("a1", "a2", "a3"):
        kept.put(("A", name), b"x" * 10)
    kept.put(("B", "b1"), b"y" * 10)
    first = kept.take(25)
    assert [key for key, _ in first] == [("A", "a1"), ("A", "a2")] and len(kept) == 2
    assert [key for key, _ in kept.take(1)] == [("A", "a3")]  # at least one, whatever the bound
    assert [key for key, _ in kept.take(1000)] == [("B", "b1")] and kept.take(1000) == []
    assert kept.usage("A") == (0, 0) and kept.taken_at == 1000.0
