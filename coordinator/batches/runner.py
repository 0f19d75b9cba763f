"""The batch runner: takes the store's running jobs (under a lease) and runs each one's lines on the
pool's idle capacity.

Owns: a job's life after `validating` (its lines read into the store, then run, then its files
written: `in_progress` -> `finalizing` -> `completed`; `cancelling` -> `cancelled`; past its window,
`expired`, each line not run an error line `batch_expired`), its pace (a line starts only while the
pool would admit a batch request now, `Room`, or when none of the job's lines runs: that one waits its
turn in the queue, behind every interactive request), a line refused for capacity or a key's rate (it
is tried again after a pause, never written as an error), and its lease (renewed while it runs; lost, it
stops and writes nothing more). Each job is a task of its own, supervised: a fault fails that batch,
logged, and the runner goes on.
Must not: parse a line's body or answer it (the `Call` given does, through the gateway as the
endpoint's own route would) or know the store's tables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from coordinator.batches import lines
from coordinator.batches.lines import Line
from coordinator.batches.store import BatchRow, Store
from coordinator.clock import Clock
from protocol import batches as wire

log = logging.getLogger("coordinator.batches")
TICK = 0.05  # seconds between looks at the pool's room while a job waits for it
CLOSE_WAIT = 10.0  # seconds a stopping job waits for its lines running to end
FETCHED = 64  # lines read from the store at a time


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint answered a line: its status and JSON body; `retry`: refused for capacity or a
    rate limit, to be asked again later."""

    status: int
    body: dict[str, Any]
    retry: bool = False


@dataclass(frozen=True, slots=True)
class Asking:
    """One line to run, and for whom: the batch's tenant and the id of the key that created it."""

    endpoint: str
    line: Line
    request_id: str
    tenant: str
    key_id: str | None
    gone: asyncio.Event  # set when the job stops: the line's request ends as a client's leaving


# The endpoint's answer to a line (None: it ended without one, its job stopping), and whether the pool
# would admit one more batch request (endpoint, body) of `tenant` now.
Call = Callable[[Asking], Coroutine[Any, Any, Answer | None]]
Room = Callable[[str, bytes, str], bool]


@dataclass(frozen=True, slots=True)
class Pace:
    lease: float  # seconds a job's lease lasts; renewed every third of it
    jobs: int  # jobs run at once by this runner
    max_in_flight: int  # lines of one job running at once, whatever the room
    poll: float = 1.0  # seconds between looks for jobs to take over
    retry: float = 1.0  # seconds a job pauses after a line was refused for capacity


class Runner:
    def __init__(self, store: Store, call: Call, room: Room, *, clock: Clock, pace: Pace,
                 ready: Callable[[], bool] = lambda: True, on_fault: Callable[[], None] = lambda: None) -> None:
        """`ready`: whether this coordinator may take jobs now (it knows the pool, and is not draining): one
        just started would answer every line `unknown_model` before its workers have beaten to it."""
        self.store, self.call, self.room, self.clock, self.pace = store, call, room, clock, pace
        self._ready = ready
        self._on_fault = on_fault
        self.owner = "runner-" + secrets.token_hex(8)
        self._jobs: dict[str, Job] = {}
        self._woken = asyncio.Event()

    def poke(self) -> None:
        """Something changed (a batch created or cancelled): look now."""
        self._woken.set()
        for job in self._jobs.values():
            job.nudged.set()

    async def run(self) -> None:
        """Forever: take jobs and start them; supervised (a fault is logged and counted, and it goes on)."""
        while True:
            try:
                await self._round()
            except Exception:
                log.exception(json.dumps({"event": "batch_runner_failed"}))
                self._on_fault()
            try:
                async with asyncio.timeout(self.pace.poll):
                    await self._woken.wait()
            except TimeoutError:
                pass
            self._woken.clear()

    async def _round(self) -> None:
        store, pace = self.store, self.pace
        await store.call(store.sweep, int(self.clock.time()))
        if len(self._jobs) >= pace.jobs or not self._ready():
            return
        rows = await store.call(store.claim, self.owner, self.clock.time(), pace.lease, pace.jobs)
        for row in rows:
            if row.batch.id not in self._jobs and len(self._jobs) < pace.jobs:
                job = Job(self, row)
                self._jobs[row.batch.id] = job
                job.task = asyncio.create_task(self._supervised(job))

    async def _supervised(self, job: Job) -> None:
        batch_id = job.row.batch.id
        try:
            await job.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(json.dumps({"event": "batch_failed", "batch_id": batch_id}))
            self._on_fault()
            error = wire.BatchError(code="internal_error", message="the batch runner failed on this batch")
            await self.store.call(self.store.finish, batch_id, self.owner, wire.FAILED, int(self.clock.time()),
                                   [error])
        finally:
            self._jobs.pop(batch_id, None)

    async def close(self) -> None:
        """Stop every job, and give their leases up so another coordinator (or this one restarted) takes
        them over at once."""
        jobs = list(self._jobs.values())
        for job in jobs:
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(job.task for job in jobs if job.task is not None), return_exceptions=True)
        for job in jobs:
            await self.store.call(self.store.release, job.row.batch.id, self.owner)


@dataclass(eq=False)
class Job:
    runner: Runner
    row: BatchRow
    nudged: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    running: dict[asyncio.Task[Answer | None], Line] = field(default_factory=dict)
    cursor: int = -1  # the last line read from the store; retried lines wait in memory
    renew_at: float = 0.0

    @property
    def id(self) -> str:
        return self.row.batch.id

    async def run(self) -> None:
        try:
            await self._run()
        finally:  # stopped or failed: no line of it runs on
            self.gone.set()
            for task in self.running:
                task.cancel()

    async def _run(self) -> None:
        status: str | None = self.row.batch.status
        if status == wire.VALIDATING:
            status = await self._validate()
        if status in (wire.IN_PROGRESS, wire.CANCELLING):
            status = await self._lines()
        elif status == wire.FINALIZING:
            status = wire.COMPLETED
        if status is not None:
            await self._finish(status)

    async def _validate(self) -> str | None:
        """The input file read into the store's lines; the status to go on with (None: lost)."""
        store, batch = self.runner.store, self.row.batch
        data = await store.call(store.content, self.row.tenant, batch.input_file_id)
        if data is None:
            error = wire.BatchError(code="file_not_found", message=f"input file {batch.input_file_id} is gone",
                                    param="input_file_id")
            await store.call(store.finish, self.id, self.runner.owner, wire.FAILED, self._now(), [error])
            return None
        items = await asyncio.to_thread(lines.read, data, batch.endpoint)
        refusals = [lines.unanswered(self.id, item).model_dump_json() for item in items
                    if isinstance(item, lines.Refused)]
        if not await store.call(store.load, self.id, self.runner.owner, items, refusals, self._now()):
            return None
        current = await self._renew()
        return current.status if current is not None else None

    async def _lines(self) -> str | None:
        """Run the lines not done; the status the batch ends with (None: the lease was lost)."""
        waiting: deque[Line] = deque()
        paused_until = 0.0
        self.renew_at = 0.0  # the first look reads its status: cancelled while it was read in, say
        while True:
            stop, status = await self._interrupted()
            if stop:
                return await self._stop(status)
            if not waiting:
                await self._refill(waiting)
            if not waiting and not self.running:
                return wire.COMPLETED
            if waiting and self._may_start(waiting[0], paused_until):
                self._start(waiting.popleft())
                continue
            paused_until = await self._collect(waiting, paused_until)

    async def _interrupted(self) -> tuple[bool, str | None]:
        """Whether the job stops now, and as what: cancelled, expired, or lost to another runner (None).
        Its lease is renewed (and its status read) every third of the lease, or when nudged."""
        clock, lease = self.runner.clock, self.runner.pace.lease
        if self.nudged.is_set() or _loop_time() >= self.renew_at:
            self.nudged.clear()
            self.renew_at = _loop_time() + lease / 3
            current = await self._renew()
            if current is None:
                return True, None
            if current.status == wire.CANCELLING:
                return True, wire.CANCELLED
        expires_at = self.row.batch.expires_at
        return (True, wire.EXPIRED) if expires_at and clock.time() >= expires_at else (False, None)

    async def _refill(self, waiting: deque[Line]) -> None:
        store = self.runner.store
        fetched = await store.call(store.pending, self.id, self.cursor, FETCHED)
        waiting.extend(fetched)
        if fetched:
            self.cursor = fetched[-1].index

    def _may_start(self, line: Line, paused_until: float) -> bool:
        """Another line now: while the pool has room for a batch request, or the first of the job
        (which waits its turn in the queue)."""
        runner = self.runner
        if _loop_time() < paused_until or len(self.running) >= runner.pace.max_in_flight:
            return False
        return not self.running or runner.room(self.row.batch.endpoint, line.body, self.row.tenant)

    def _start(self, line: Line) -> None:
        asking = Asking(self.row.batch.endpoint, line, lines.line_id(self.id, line.index), self.row.tenant,
                        self.row.key_id, self.gone)
        self.running[asyncio.create_task(self.runner.call(asking))] = line

    async def _collect(self, waiting: deque[Line], paused_until: float) -> float:
        """Wait a tick for lines to end, and record each answer (a refusal for capacity goes back to wait,
        and the job pauses); the pause's new end."""
        runner = self.runner
        if not self.running:
            await asyncio.sleep(TICK)
            return paused_until
        done, _ = await asyncio.wait(self.running, timeout=TICK, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            line = self.running.pop(task)
            answer = task.result()
            if answer is None:
                waiting.appendleft(line)
            elif answer.retry:
                waiting.appendleft(line)
                paused_until = _loop_time() + runner.pace.retry
            else:
                await self._record(line, answer)
        return paused_until

    async def _record(self, line: Line, answer: Answer) -> None:
        store = self.runner.store
        result = lines.answered(self.id, line.index, line.custom_id, answer.status, answer.body)
        await store.call(store.record, self.id, self.runner.owner, line.index, result.model_dump_json(),
                         failed=answer.status >= 400)

    async def _stop(self, status: str | None) -> str | None:
        """End the lines running (as a client's leaving), keeping the answers that came whole."""
        self.gone.set()
        if self.running:
            done, late = await asyncio.wait(self.running, timeout=CLOSE_WAIT)
            for task in late:
                task.cancel()
            for task in done:
                answer = task.result()
                if status is not None and answer is not None and not answer.retry:
                    await self._record(self.running[task], answer)
        if status == wire.EXPIRED:
            store = self.runner.store
            for index, custom_id in await store.call(store.undone, self.id):
                refused = lines.Refused(index, custom_id, wire.LineError(
                    code="batch_expired", message="the batch's completion window ended before this line ran"))
                await store.call(store.record, self.id, self.runner.owner, index,
                                 lines.unanswered(self.id, refused).model_dump_json(), failed=True)
        return status

    async def _finish(self, status: str) -> None:
        store, owner = self.runner.store, self.runner.owner
        if status == wire.COMPLETED and not await store.call(store.enter, self.id, owner, wire.FINALIZING, self._now()):
            return
        await store.call(store.finish, self.id, owner, status, self._now())

    async def _renew(self) -> wire.Batch | None:
        runner = self.runner
        return await runner.store.call(runner.store.renew, self.id, runner.owner, runner.clock.time(),
                                        runner.pace.lease)

    def _now(self) -> int:
        return int(self.runner.clock.time())


def _loop_time() -> float:
    """The event loop's clock, for the runner's own pauses and renewals (which are waits on the loop);
    the injected clock's wall time stamps the store (leases, statuses, windows) that coordinators share."""
    return asyncio.get_running_loop().time()
