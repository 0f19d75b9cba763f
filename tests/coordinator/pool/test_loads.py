"""pool/loads.py: a burst for an offered model makes one ask, to the least busy worker offering it, and
each try is told `loading` (it waits in the queue: tests/coordinator/test_gateway_waits.py) until a
worker serves it; a failed load refuses with the worker's reason until its pause is over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest

from coordinator.errors import CoordinatorError
from coordinator.pool.loads import BUSY_AGAIN, FAILED_AGAIN, HOLD, ModelLoads
from coordinator.pool.registry import Registry
from protocol import reasons
from protocol.health import OfferedModel
from tests.coordinator.fakes import heartbeat

pytestmark = pytest.mark.anyio
GEMMA = OfferedModel(name="gemma", state="offered", need_bytes=10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Asked:
    """The workers' side of the asks: what each answers, and who was asked."""

    def __init__(self, status: int = 202, body: bytes = b'{"model": "gemma", "state": "loading"}') -> None:
        self.status, self.body, self.urls = status, body, []

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        self.urls.append(url)
        return self.status, self.body


def beat(reg: Registry, worker_id: str, model: str, *, sessions: int = 0, offered: tuple[OfferedModel, ...] = (GEMMA,)
         ) -> None:
    reg.upsert(heartbeat(worker_id, timestamp=1, model=model, sessions=sessions).model_copy(
        update={"offered": list(offered)}), now=time.monotonic())


def loads(reg: Registry, asked: Any) -> ModelLoads:
    return ModelLoads(reg, asked, now=time.monotonic)


async def tried(on_demand: ModelLoads, model: str) -> str:
    """One try at `model`: "served", or the reason it is refused."""
    try:
        await on_demand.wanted(model)
    except CoordinatorError as exc:
        return exc.reason
    return "served"


async def test_a_worker_that_loads_the_model_beside_those_it_serves_is_asked_before_a_less_busy_one() -> None:
    """WORKER_MAX_MODELS: the busier worker has a free slot and the memory; the idle one would have to swap."""
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked()
    beat(reg, "idle", "smol", sessions=0)
    beat(reg, "roomy", "smol", sessions=3, offered=(GEMMA.model_copy(update={"beside": True}),))
    on_demand = loads(reg, asked)
    assert await tried(on_demand, "gemma") == reasons.LOADING
    assert asked.urls == ["http://roomy.test/worker/models/load"]
    beat(reg, "roomy.m1", "gemma", offered=())
    assert await tried(on_demand, "gemma") == "served"


async def test_a_burst_makes_one_ask_of_the_least_busy_worker_and_returns_once_it_serves_the_model() -> None:
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked()
    beat(reg, "busy", "smol", sessions=3)
    beat(reg, "idle", "smol", sessions=0)
    on_demand = loads(reg, asked)
    burst = await asyncio.gather(*(tried(on_demand, "gemma") for _ in range(5)))
    assert asked.urls == ["http://idle.test/worker/models/load"] and burst == [reasons.LOADING] * 5
    assert on_demand.loading("gemma") and not on_demand.loading("smol")
    beat(reg, "idle", "gemma", offered=(OfferedModel(name="gemma", state="loaded"),))
    assert await asyncio.gather(*(tried(on_demand, "gemma") for _ in range(5))) == ["served"] * 5
    assert on_demand.asked == 1 and not on_demand.loading("gemma")


async def test_a_failed_load_refuses_with_the_workers_reason_until_its_pause_is_over() -> None:
    reg = Registry(stale_after=30.0, dead_after=60.0)
    beat(reg, "w1", "smol")
    failed = Asked(503, b'{"error": "model \'gemma\' failed to load (RuntimeError: no room)", '
                        b'"reason": "model_load_failed", "request_id": "r"}')
    clock = [time.monotonic()]
    on_demand = ModelLoads(reg, failed, now=lambda: clock[0])
    for _ in range(2):  # the second request gets the same answer without asking again
        with pytest.raises(CoordinatorError) as refused:
            await on_demand.wanted("gemma")
        assert refused.value.reason == reasons.MODEL_LOAD_FAILED and "no room" in str(refused.value)
    assert on_demand.asked == 1 and not on_demand.loading("gemma")
    clock[0] += FAILED_AGAIN
    with pytest.raises(CoordinatorError):
        await on_demand.wanted("gemma")
    assert on_demand.asked == 2  # asked again once the pause is over


async def test_a_worker_busy_swapping_to_another_model_is_asked_again_soon() -> None:
    reg = Registry(stale_after=30.0, dead_after=60.0)
    beat(reg, "w1", "smol")
    busy = Asked(503, b'{"error": "swapping to x", "reason": "model_swapping", "request_id": "r"}')
    clock = [time.monotonic()]
    on_demand = ModelLoads(reg, busy, now=lambda: clock[0])
    assert await tried(on_demand, "gemma") == reasons.LOADING  # a request waits, woken by heartbeats
    clock[0] += BUSY_AGAIN - 0.1
    assert await tried(on_demand, "gemma") == reasons.LOADING and on_demand.asked == 1
    clock[0] += 0.1
    assert await tried(on_demand, "gemma") == reasons.LOADING and on_demand.asked == 2  # again after BUSY_AGAIN


async def test_a_model_a_worker_swaps_to_or_away_from_waits_for_the_swap_without_an_ask() -> None:
    """The only worker drains for a swap (its heartbeats say where it goes): a request for the model it
    swaps to, and one for the model it leaves, wait; the one it leaves is asked for once it serves the
    other, undrained."""
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked()
    smol = OfferedModel(name="smol", aliases=["a-smol"], state="loaded")
    reg.upsert(heartbeat("w1", timestamp=1, model="smol", draining=True).model_copy(
        update={"offered": [smol, GEMMA], "swapping": "gemma"}), now=time.monotonic())
    assert reg.offered_as("a-smol") == "smol" and reg.offered_as("gemma") == "gemma"
    assert reg.swap_involves("smol") and reg.swap_involves("gemma") and not reg.swap_involves("other")
    on_demand = loads(reg, asked)
    assert on_demand.loading("gemma") and not on_demand.loading("smol")  # /v1/models: whoever asked for it
    assert [await tried(on_demand, m) for m in ("gemma", "smol")] == [reasons.LOADING] * 2
    assert asked.urls == []  # no ask, no refusal: the swap runs (their requests wait in the queue)
    await asyncio.sleep(0.3)
    reg.upsert(heartbeat("w1", timestamp=2, model="gemma").model_copy(update={"offered": [
        OfferedModel(name="smol", aliases=["a-smol"], state="offered"), OfferedModel(name="gemma", state="loaded")]}),
        now=time.monotonic())
    assert await tried(on_demand, "gemma") == "served"
    swapped = reg.get("w1")
    assert swapped is not None and swapped.last_swap_s is not None and 0.25 <= swapped.last_swap_s < 2  # beats apart
    await asyncio.sleep(1.5)  # its requests are let in (HOLD) before the model it left is asked for
    assert await tried(on_demand, "smol") == reasons.LOADING and HOLD == 2.0 and asked.urls == []
    await asyncio.sleep(0.8)
    assert await tried(on_demand, "smol") == reasons.LOADING and asked.urls == ["http://w1.test/worker/models/load"]


async def test_a_draining_worker_that_is_not_swapping_does_not_hold_requests() -> None:
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked()
    reg.upsert(heartbeat("w1", timestamp=1, model="smol", draining=True).model_copy(
        update={"offered": [OfferedModel(name="smol", state="loaded"), GEMMA]}), now=time.monotonic())
    assert reg.offered_as("smol") is None and not reg.swap_involves("gemma")
    assert await tried(loads(reg, asked), "gemma") == reasons.MODEL_UNAVAILABLE and asked.urls == []


async def test_a_worker_in_standby_serves_nothing_and_is_asked_to_load_the_model_it_unloaded() -> None:
    """Its model unloaded after its keep-alive, the worker's heartbeats say `standby` (draining, nothing
    loaded): its model is listed as offered, not served, and a request for it asks that worker for a load."""
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked(body=b'{"model": "smol", "state": "loading"}')
    unloaded = (OfferedModel(name="smol", aliases=["a-smol"], state="offered"), GEMMA)
    reg.upsert(heartbeat("w1", timestamp=1, model="smol", draining=True).model_copy(
        update={"offered": list(unloaded), "standby": True}), now=time.monotonic())
    assert reg.alive_models() == [] and reg.offered_models() == {"gemma": ["w1"], "smol": ["w1"]}
    assert reg.offered_as("a-smol") == "smol" and not reg.swap_involves("smol")
    on_demand = loads(reg, asked)
    assert await tried(on_demand, "smol") == reasons.LOADING
    assert asked.urls == ["http://w1.test/worker/models/load"]
    reg.upsert(heartbeat("w1", timestamp=2, model="smol").model_copy(update={"offered": [
        OfferedModel(name="smol", aliases=["a-smol"], state="loaded"), GEMMA]}), now=time.monotonic())
    assert await tried(on_demand, "smol") == "served"
    assert reg.alive_models() == ["smol"] and reg.offered_models() == {"gemma": ["w1"]}


async def test_a_heartbeat_that_shows_the_model_served_answers_its_ask_so_a_later_swap_asks_again() -> None:
    """A request let in by the heartbeat never calls again: the ask is answered there (`served`), or a
    model swapped away later would wait ASK_AGAIN for an ask already answered."""
    reg, asked = Registry(stale_after=30.0, dead_after=60.0), Asked()
    beat(reg, "w1", "smol")
    on_demand = loads(reg, asked)
    assert await tried(on_demand, "gemma") == reasons.LOADING and on_demand.loading("gemma")
    on_demand.served("gemma")
    assert not on_demand.loading("gemma")
    assert await tried(on_demand, "gemma") == reasons.LOADING and on_demand.asked == 2
