"""The worker's headroom by tenant (worker/headroom.py): which requests the last free sequences are
kept from, and for how long a tenant counts as active."""

from __future__ import annotations

import pytest

from worker.headroom import GRACE, MAX_TENANTS, Headroom

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_tenant_alone_takes_every_sequence() -> None:
    room = Headroom(16, Clock())
    room.seen("heavy")
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 15})


def test_the_last_free_sequence_is_kept_from_a_tenant_at_its_share_for_one_below_it() -> None:
    room = Headroom(16, Clock())
    room.seen("light")
    assert room.keeps("heavy", 1.0, 1, {"heavy": 15})  # 1 free: kept for light
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 14})  # 2 free: one for heavy, one left for light
    assert not room.keeps("light", 1.0, 1, {"heavy": 15})  # light itself takes it
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 7})  # heavy below its share (8 of 16) takes any
    assert room.keeps("heavy", 1.0, 1, {"heavy": 8, "light": 7})  # heavy at its share: light's is kept
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 7, "light": 8})  # light at its share: none kept for it


def test_one_sequence_is_kept_for_each_tenant_below_its_share() -> None:
    room = Headroom(16, Clock())
    for tenant in ("a", "b"):
        room.seen(tenant)
    assert room.keeps("heavy", 1.0, 1, {"heavy": 14})  # 2 free, both kept: for a and for b
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 13})
    assert not room.keeps("heavy", 1.0, 2, {"heavy": 12})  # n=2 leaves 2 free: enough; n=3 would not
    assert room.keeps("heavy", 1.0, 3, {"heavy": 12})


def test_weights_size_the_shares() -> None:
    room = Headroom(16, Clock())
    room.seen("light", 1.0)
    assert not room.keeps("heavy", 3.0, 1, {"heavy": 11})  # heavy's share is 12 of 16
    assert room.keeps("heavy", 3.0, 1, {"heavy": 12, "light": 3})  # light below its 4: the last kept
    room.seen("light", 0.5)
    assert room.keeps("heavy", 3.0, 1, {"heavy": 14, "light": 1})  # light's share is 16 x 0.5 / 3.5 = 2.3


def test_a_tenant_is_active_while_it_runs_waits_here_or_within_the_grace_of_its_last_request() -> None:
    clock = Clock()
    room = Headroom(16, clock)
    room.seen("light")
    clock.now += GRACE - 0.1
    assert room.keeps("heavy", 1.0, 1, {"heavy": 15})
    clock.now += 0.2
    assert not room.keeps("heavy", 1.0, 1, {"heavy": 15})  # gone quiet: nothing kept for it
    assert room.keeps("heavy", 1.0, 1, {"heavy": 14, "light": 1})  # it runs here: active again
    assert room.keeps("heavy", 1.0, 1, {"heavy": 15}, waiting=["light"])  # it waits in line here


def test_tenants_remembered_are_bounded() -> None:
    clock = Clock()
    room = Headroom(16, clock)
    for i in range(MAX_TENANTS + 10):
        room.seen(f"t{i}")
    assert len(room._seen) == MAX_TENANTS
    assert "t0" not in room._seen and f"t{MAX_TENANTS + 9}" in room._seen
