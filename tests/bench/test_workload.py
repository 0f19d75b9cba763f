"""bench.load.workload: deterministic sequences, Poisson arrivals, and the two drivers' bounds."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

import pytest

from bench.load.workload import PROMPTS, WorkItem, Workload, closed_loop, open_loop


def test_items_are_deterministic_per_seed() -> None:
    a = list(Workload(seed=7).items(50))
    assert a == list(Workload(seed=7).items(50))
    assert a != list(Workload(seed=8).items(50))
    assert [i.index for i in a] == list(range(50))
    assert {i.prompt for i in a} <= set(PROMPTS)
    assert len({i.seed for i in a}) > 40  # sampling seeds differ between requests


def test_items_stop_at_the_limit() -> None:
    assert len(list(Workload(seed=0).items(3))) == 3


def test_arrivals_are_deterministic_increasing_and_at_the_rate() -> None:
    offsets = list(itertools.islice(Workload(seed=3).arrivals(4.0), 4000))
    assert offsets == list(itertools.islice(Workload(seed=3).arrivals(4.0), 4000))
    assert all(b > a for a, b in itertools.pairwise(offsets))
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)


def test_prompt_sequence_does_not_depend_on_arrivals() -> None:
    workload = Workload(seed=5)
    before = list(workload.items(10))
    list(itertools.islice(workload.arrivals(10.0), 100))
    assert list(workload.items(10)) == before


@pytest.mark.parametrize("bad", [{"prompts": ()}, {"rate": 0.0}])
def test_bad_workloads_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        if "prompts" in bad:
            Workload(bad["prompts"])
        else:
            next(Workload().arrivals(bad["rate"]))


def test_closed_loop_keeps_exactly_n_in_flight_and_sends_every_item() -> None:
    in_flight, peak, sent = 0, 0, []

    async def send(item: WorkItem) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.002)
        sent.append(item.index)
        in_flight -= 1

    asyncio.run(closed_loop(send, Workload().items(30), 4, stop_at=None, clock=time.monotonic))
    assert peak == 4
    assert sorted(sent) == list(range(30))


def test_closed_loop_starts_nothing_after_its_deadline() -> None:
    now = [0.0]
    started = []

    async def send(item: WorkItem) -> None:
        started.append(now[0])
        now[0] += 1.0  # each request takes one (virtual) second
        await asyncio.sleep(0)

    asyncio.run(closed_loop(send, Workload().items(1000), 1, stop_at=5.0, clock=lambda: now[0]))
    assert started == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_open_loop_starts_each_item_at_its_offset_without_waiting_for_the_others() -> None:
    now = [0.0]
    starts: list[float] = []

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)  # like a real sleep: the tasks already started run before time moves
        now[0] += seconds

    async def main() -> None:
        gate = asyncio.Event()

        async def send(item: WorkItem) -> None:
            starts.append(now[0])
            await gate.wait()  # nothing finishes until every arrival has started: open loop

        offsets = iter([0.5, 1.0, 1.25, 4.0, 9.0, 12.0])
        driver = asyncio.create_task(open_loop(send, Workload().items(100), offsets, duration=10.0,
                                               clock=lambda: now[0], sleep=sleep))
        while len(starts) < 5:
            await asyncio.sleep(0)
        gate.set()
        await driver

    asyncio.run(main())
    assert starts == [0.5, 1.0, 1.25, 4.0, 9.0]  # 12.0 is past the duration


def test_open_loop_stops_at_the_end_of_its_items() -> None:
    sent = []

    async def send(item: WorkItem) -> None:
        sent.append(item.index)

    asyncio.run(open_loop(send, Workload().items(5), Workload().arrivals(1000.0), duration=None,
                          clock=time.monotonic))
    assert sent == [0, 1, 2, 3, 4]
