"""The batch runner (coordinator/batches/runner.py) with a fake endpoint and a fake pool's room: its pace
follows the room, a refusal for capacity is asked again (never an error line), a job stopped and taken
over runs each line once, a job past its window expires."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.batches.runner import Answer, Asking, Pace, Runner
from coordinator.batches.store import Bounds, Store
from coordinator.clock import ManualClock
from protocol import batches as wire
from tests.coordinator.batches.test_store import chat_lines

pytestmark = pytest.mark.anyio
BOUNDS = Bounds(file_bytes=1 << 20, file_lines=1000, tenant_files=10, tenant_bytes=1 << 22, retention=86_400)
PACE = Pace(lease=30.0, jobs=2, max_in_flight=8, poll=0.05, retry=0.01)


@dataclass
class Endpoint:
    """Answers each line after `release` is set (when given); notes how many ran at once."""

    release: asyncio.Event | None = None
    held_from: int = 0  # lines before this one are answered at once, whatever `release`
    refuse_first: int = 0  # this many asks are refused for capacity first
    asked: list[str] = field(default_factory=list)
    running: int = 0
    most: int = 0

    async def call(self, asking: Asking) -> Answer | None:
        self.asked.append(asking.line.custom_id)
        if self.refuse_first > 0:
            self.refuse_first -= 1
            return Answer(503, {"error": {"code": "sessions_full"}}, retry=True)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.release is not None and int(asking.line.custom_id[1:]) >= self.held_from:
                stopped = asyncio.ensure_future(asking.gone.wait())
                await asyncio.wait((asyncio.ensure_future(self.release.wait()), stopped),
                                   return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():
                    return None
            return Answer(200, {"echo": json.loads(asking.line.body)["messages"][0]["content"]})
        finally:
            self.running -= 1


@asynccontextmanager
async def running(store: Store, endpoint: Endpoint, room: Callable[[str, bytes, str], bool], clock: ManualClock,
                  pace: Pace = PACE) -> AsyncIterator[Runner]:
    runner = Runner(store, endpoint.call, room, clock=clock, pace=pace)
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.close()


def submit(store: Store, clock: ManualClock, n: int) -> str:
    file = store.add_file("t:a", "in.jsonl", wire.BATCH, chat_lines(n), int(clock.time()))
    return store.create_batch("t:a", None, wire.BatchCreate(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                            completion_window="24h"), int(clock.time()), 86_400).id


async def until(store: Store, batch_id: str, done: Callable[[wire.Batch], bool], timeout: float = 5.0) -> wire.Batch:
    async with asyncio.timeout(timeout):
        while True:
            batch = store.batch("t:a", batch_id)
            assert batch is not None
            if done(batch):
                return batch
            await asyncio.sleep(0.01)


def output(store: Store, file_id: str | None) -> list[dict[str, object]]:
    return [json.loads(line) for line in (store.content("t:a", file_id or "") or b"").splitlines()]


async def test_with_no_room_one_line_runs_at_a_time_and_with_room_more(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    room = {"free": False}
    endpoint = Endpoint(release=asyncio.Event())
    async with running(store, endpoint, lambda endpoint, body, tenant: room["free"], clock):
        batch_id = submit(store, clock, 12)
        async with asyncio.timeout(5):
            while not endpoint.running:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert endpoint.running == 1  # the pool has no room: only the job's first line, which waits its turn
        room["free"] = True
        async with asyncio.timeout(5):
            while endpoint.running < PACE.max_in_flight:
                await asyncio.sleep(0.01)
        endpoint.release.set()  # type: ignore[union-attr]
        done = await until(store, batch_id, lambda b: b.status == wire.COMPLETED)
    assert endpoint.most == PACE.max_in_flight and done.request_counts.completed == 12


async def test_a_line_refused_for_capacity_is_asked_again_not_written_as_an_error(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    endpoint = Endpoint(refuse_first=3)
    async with running(store, endpoint, lambda *_: True, clock):
        batch_id = submit(store, clock, 5)
        done = await until(store, batch_id, lambda b: b.status == wire.COMPLETED)
    assert (done.request_counts.completed, done.request_counts.failed, done.error_file_id) == (5, 0, None)
    assert len(endpoint.asked) == 8 and sorted(set(endpoint.asked)) == [f"c{i}" for i in range(5)]
    assert sorted(line["custom_id"] for line in output(store, done.output_file_id)) == [f"c{i}" for i in range(5)]


async def test_a_job_stopped_midway_is_taken_over_and_each_line_answered_once(tmp_path: Path) -> None:
    clock = ManualClock()
    store = Store(tmp_path, BOUNDS)
    first = Endpoint(release=asyncio.Event(), held_from=4)  # c4 on never answers
    async with running(store, first, lambda *_: False, clock):  # no room: one line at a time
        batch_id = submit(store, clock, 10)
        await until(store, batch_id, lambda b: b.request_counts.completed == 4)
        async with asyncio.timeout(5):  # the fifth is running, unanswered, as the coordinator stops
            while not first.running:
                await asyncio.sleep(0.005)
    stopped = store.batch("t:a", batch_id)
    assert stopped is not None and stopped.status == wire.IN_PROGRESS and stopped.request_counts.completed == 4
    store.close()
    again, second = Store(tmp_path, BOUNDS), Endpoint()
    async with running(again, second, lambda *_: True, clock):
        done = await until(again, batch_id, lambda b: b.status == wire.COMPLETED)
    assert sorted(second.asked) == sorted(f"c{i}" for i in range(4, 10))  # the four done are not asked again
    answered = [line["custom_id"] for line in output(again, done.output_file_id)]
    assert answered == [f"c{i}" for i in range(10)] and done.request_counts.completed == 10


async def test_a_job_past_its_window_expires_and_its_lines_not_run_are_error_lines(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    endpoint = Endpoint(release=asyncio.Event())
    async with running(store, endpoint, lambda *_: False, clock):
        batch_id = submit(store, clock, 3)
        async with asyncio.timeout(5):
            while not endpoint.running:
                await asyncio.sleep(0.01)
        clock.advance(86_401)
        done = await until(store, batch_id, lambda b: b.status == wire.EXPIRED)
    errors = output(store, done.error_file_id)
    assert [line["custom_id"] for line in errors] == ["c0", "c1", "c2"]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}  # type: ignore[index]
    assert done.output_file_id is None and done.expired_at is not None


async def test_a_batch_cancelled_before_its_runner_took_it_runs_no_line(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    endpoint = Endpoint()
    batch_id = submit(store, clock, 5)
    assert store.cancel("t:a", batch_id, int(clock.time())) is not None
    async with running(store, endpoint, lambda *_: True, clock):
        done = await until(store, batch_id, lambda b: b.status == wire.CANCELLED, timeout=2)
    assert endpoint.asked == [] and done.output_file_id is None


async def test_a_runner_takes_no_job_until_its_coordinator_is_ready(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    endpoint, ready = Endpoint(), {"now": False}
    runner = Runner(store, endpoint.call, lambda *_: True, clock=clock, pace=PACE, ready=lambda: ready["now"])
    task = asyncio.create_task(runner.run())
    try:
        batch_id = submit(store, clock, 3)
        await asyncio.sleep(0.3)
        waiting = store.batch("t:a", batch_id)
        assert waiting is not None and waiting.status == wire.VALIDATING and endpoint.asked == []
        ready["now"] = True
        await until(store, batch_id, lambda b: b.status == wire.COMPLETED)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.close()


async def test_a_runner_that_lost_its_lease_stops_the_job_and_writes_nothing_more(tmp_path: Path) -> None:
    store, clock = Store(tmp_path, BOUNDS), ManualClock()
    endpoint = Endpoint(release=asyncio.Event())
    async with running(store, endpoint, lambda *_: True, clock) as runner:
        batch_id = submit(store, clock, 6)
        async with asyncio.timeout(5):
            while endpoint.running < 6:
                await asyncio.sleep(0.01)
        clock.advance(PACE.lease + 1)  # it stalled past its lease: another coordinator takes the job over
        assert [row.batch.id for row in store.claim("other", clock.time(), PACE.lease, 4)] == [batch_id]
        runner.poke()
        async with asyncio.timeout(5):
            while endpoint.running:
                await asyncio.sleep(0.01)  # its lines end (as a client's leaving)
        endpoint.release.set()  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
    taken = store.batch("t:a", batch_id)
    assert taken is not None and taken.status == wire.IN_PROGRESS and taken.request_counts.completed == 0
    assert [line.index for line in store.pending(batch_id, -1, 10)] == list(range(6))  # all left to the other
