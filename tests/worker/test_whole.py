"""worker/runtime.py `whole`: a load's thread cannot be stopped, so a stop that comes meanwhile waits
for it and undoes what it made, instead of freeing the model under it (issue 50: `Segmentation fault`)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker.runtime import whole

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_cancelled_load_waits_for_its_thread_then_undoes_what_it_made() -> None:
    release, events = threading.Event(), []

    def load() -> str:
        release.wait(5)
        events.append("loaded")
        return "model"

    task = asyncio.ensure_future(whole(load, lambda made: events.append(f"closed {made}")))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done() and events == []  # still waiting on the thread: nothing freed under it
    task.cancel()  # a second cancel does not cut the wait short
    await asyncio.sleep(0.05)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["loaded", "closed model"]


async def test_a_load_not_cancelled_is_its_result_and_a_stuck_one_is_left_after_the_wait() -> None:
    assert await whole(lambda: 7, lambda _: pytest.fail("undone")) == 7
    release = threading.Event()
    task = asyncio.ensure_future(whole(lambda: release.wait(5), lambda _: pytest.fail("undone"), wait=0.1))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    release.set()
