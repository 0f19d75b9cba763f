"""admission/waiting.py: the line a request waits in, and which refusals it waits out there."""

from __future__ import annotations

import time

import pytest

from coordinator.admission.waiting import WaitingRoom
from coordinator.errors import CoordinatorError
from coordinator.pool.loads import ModelLoads
from coordinator.pool.registry import Registry
from protocol import reasons
from protocol.health import OfferedModel
from tests.coordinator.fakes import heartbeat

pytestmark = pytest.mark.unit


def room(reg: Registry, **over: object) -> WaitingRoom:
    loads = ModelLoads(reg, None, now=time.monotonic)  # type: ignore[arg-type]
    values: dict[str, object] = {"default_model": None, "any_model_name": False, "model_loads": True, **over}
    return WaitingRoom(reg, loads, **values)  # type: ignore[arg-type]


def test_the_line_is_the_served_model_meant_else_the_offered_one_named_else_the_name() -> None:
    reg = Registry(stale_after=30.0, dead_after=60.0)
    assert room(reg).line(None) is None  # nothing known: admission answers no_workers
    reg.upsert(heartbeat("w1", timestamp=1, model="smol", aliases=("tiny",)).model_copy(update={"offered": [
        OfferedModel(name="smol", state="loaded"), OfferedModel(name="gemma", aliases=["b-gemma"], state="offered")]}),
        now=time.monotonic())
    waiting = room(reg)
    assert [waiting.line(name) for name in (None, "tiny", "b-gemma", "gpt-9")] == ["smol", "smol", "gemma", "gpt-9"]
    assert room(reg, any_model_name=True).line("gpt-9") == "smol"  # any name means the only model


def test_capacity_is_waited_for_and_a_want_of_workers_only_while_the_pool_changes() -> None:
    reg = Registry(stale_after=30.0, dead_after=60.0)
    reg.upsert(heartbeat("w1", timestamp=1, model="smol", draining=True).model_copy(
        update={"offered": [OfferedModel(name="smol", state="loaded"), OfferedModel(name="gemma", state="offered")],
                "swapping": "gemma"}), now=time.monotonic())
    waits = room(reg).waits
    assert waits("smol")(CoordinatorError(reasons.KV_FULL, "full"))
    assert waits("smol")(CoordinatorError(reasons.DRAINING, "swapping away"))  # the heartbeats say it swaps
    assert waits("other")(CoordinatorError(reasons.MODEL_SWAPPING, "a worker says so"))
    assert not waits("other")(CoordinatorError(reasons.DRAINING, "a drain, no swap"))
    assert not waits("smol")(CoordinatorError(reasons.PROMPT_TOO_LONG, "never"))
