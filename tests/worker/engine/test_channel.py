"""A request's channel: what its consumer takes at once, and in what order."""

from __future__ import annotations

import asyncio
import threading

from worker.engine.channel import TokenChannel


def test_get_all_waits_for_the_first_item_then_takes_everything_in_order() -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        loop = asyncio.get_running_loop()
        channel = TokenChannel[int](loop, capacity=8)
        waiting = asyncio.ensure_future(channel.get_all())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing pushed yet

        def engine() -> None:  # pushes two steps' items, then wakes the consumer once
            for item in (1, 2, 3):
                channel.push(item)
            loop.call_soon_threadsafe(channel.wake)

        thread = threading.Thread(target=engine)
        thread.start()
        first = await asyncio.wait_for(waiting, 5)
        thread.join()
        channel.push(4)
        channel.push(5, terminal=True)
        channel.push(6)  # after the terminal item: dropped
        second = await asyncio.wait_for(channel.get_all(), 5)
        return first, second, list(channel._items)

    first, second, left = asyncio.run(main())
    assert (first, second, left) == ([1, 2, 3], [4, 5], [])
