"""The relay's bounded buffer: order, refusal when full, waking either side, the producer's deadline."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.relay.buffer import EventBuffer

pytestmark = pytest.mark.anyio


async def test_keeps_order_and_refuses_past_its_size() -> None:
    buffer: EventBuffer[int] = EventBuffer(2)
    assert buffer.put_nowait(1) and buffer.put_nowait(2)
    assert not buffer.put_nowait(3)
    assert buffer.qsize() == 2
    assert [await buffer.get(), await buffer.get()] == [1, 2]


async def test_a_waiting_consumer_is_woken_by_the_next_item() -> None:
    buffer: EventBuffer[str] = EventBuffer(4)
    getter = asyncio.create_task(buffer.get())
    await asyncio.sleep(0)
    assert not getter.done()
    buffer.put_nowait("x")
    assert await asyncio.wait_for(getter, 1) == "x"


async def test_a_waiting_producer_gets_room_when_the_consumer_takes_an_item() -> None:
    buffer: EventBuffer[int] = EventBuffer(1)
    buffer.put_nowait(1)
    putter = asyncio.create_task(buffer.put(2, timeout=5))
    await asyncio.sleep(0)
    assert not putter.done()
    assert await buffer.get() == 1
    assert await asyncio.wait_for(putter, 1) is True
    assert await buffer.get() == 2


async def test_a_producer_gives_up_at_its_deadline_and_the_buffer_is_unchanged() -> None:
    buffer: EventBuffer[int] = EventBuffer(1)
    buffer.put_nowait(1)
    assert await buffer.put(2, timeout=0.05) is False
    assert buffer.qsize() == 1 and await buffer.get() == 1


def test_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EventBuffer(0)
