"""The one supervisor of a relayed request's life on the client side, streamed or collected.

Owns: the three tasks every admitted request runs (the relay's reader, the consumer that turns the
relay's buffer into the client's response, and the watch for the client leaving), the rules that
say how the request ended (`Ending`), what the client gets when the consumer itself fails (an `error`
event after the first byte, the surface's error body before it), and calling `on_end` exactly once,
guarded, however the request ended.
Must not: know a wire format (a subclass's `consume` and `fail` write the bytes) or account for the
request (`on_end` does, in the gateway).

Why one supervisor: the streamed and the collected answer once each wrote these rules, and they
drifted (a collector's bug was recorded as the client leaving, and answered nothing). Every failure
after admission now ends here in one of four ways, each logged once and counted once:
- `COMPLETE`: the final event (the worker's `done` or `error`, or the relay's own `error` when its
  reader or its final callback failed) reached the client;
- `CLIENT_GONE` and `SLOW_CLIENT`: nobody is left to tell;
- `INTERNAL`: the consumer raised; the client gets an `internal` error, within the write deadline.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coordinator.relay.stream import Relay
from protocol import reasons
from protocol.sse import SseEvent


class Ending(enum.Enum):
    COMPLETE = "complete"  # the done or error event reached the client
    CLIENT_GONE = "client_gone"
    SLOW_CLIENT = "slow_client"
    INTERNAL = "internal"  # the consumer itself failed: a bug, logged with its traceback


class SendTimeout(Exception):
    """A consumer's write passed its deadline: the client is not reading."""


async def client_left_of(receive: Receive) -> None:
    """Returns when the client has gone (the only message a request whose body was read gets)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class SupervisedResponse(Response):
    """A response that relays `relay` to the client. Subclasses write the bytes: `consume` (until the
    final event is delivered), `complete` (after it), `fail` (the client's ending when `consume` raised)."""

    task = "consumer"  # the `task` label of this consumer's internal errors

    def __init__(self, relay: Relay, *, on_end: Callable[[Ending], None], headers: dict[str, str] | None = None,
                 media_type: str | None = None) -> None:
        super().__init__(content=None, status_code=200, headers=headers, media_type=media_type)
        self.relay = relay
        self.on_end = on_end

    # -- what a subclass writes ---------------------------------------------------------------------

    async def consume(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    async def complete(self, send: Send) -> None:
        """After `consume` returned: anything the response still needs to end (default nothing)."""

    async def fail(self, scope: Scope, receive: Receive, send: Send, error: SseEvent) -> None:
        """Tell the client about `error` (an `internal` error event) after `consume` raised."""
        raise NotImplementedError

    def slow(self) -> bool:
        """Whether the consumer gave up on a client that stopped reading (beyond the relay's own signal)."""
        return False

    def watch(self, consumer: asyncio.Task[None]) -> Callable[[], None]:
        """Arms whatever watches the consumer while it runs; returns how to disarm it."""
        return lambda: None

    # -- the rules, once ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ending = Ending.CLIENT_GONE
        consumer = asyncio.create_task(self.consume(scope, receive, send))  # first: the first event is queued
        reader = asyncio.create_task(self.relay.run())
        client_left = asyncio.create_task(client_left_of(receive))
        disarm = self.watch(consumer)
        try:
            await self._first_to_end(consumer, client_left, reader)
            ending = self._ending(consumer)
            if ending is Ending.COMPLETE:
                await self.complete(send)
            elif ending is Ending.INTERNAL:
                await self._fail(scope, receive, send)
        except SendTimeout:
            pass  # every event was delivered; uvicorn closes the connection we could not finish
        finally:
            disarm()
            consumer.cancel()
            client_left.cancel()
            if ending is not Ending.COMPLETE:
                reader.cancel()  # closes the worker response: the worker cancels and frees the KV
            await asyncio.gather(reader, consumer, client_left, return_exceptions=True)
            try:
                self.on_end(ending)
            except Exception as exc:  # noqa: BLE001 - the response is over; what failed is the accounting
                self.relay.internal_error("on_end", exc)

    def _ending(self, consumer: asyncio.Task[None]) -> Ending:
        fault = consumer.exception() if consumer.done() and not consumer.cancelled() else None
        if consumer.done() and not consumer.cancelled() and fault is None:
            return Ending.COMPLETE
        if isinstance(fault, SendTimeout) or self.slow() or self.relay.slow:
            return Ending.SLOW_CLIENT
        if fault is not None:
            self.relay.internal_error(self.task, fault)
            return Ending.INTERNAL
        return Ending.CLIENT_GONE

    async def _fail(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The client's ending after a consumer's fault, bounded by the write deadline; a failure here
        too leaves the connection to uvicorn, which closes it."""
        error = self.relay.error_event(reasons.INTERNAL, "internal error while writing the response")
        try:
            async with asyncio.timeout(self.relay.write_deadline):
                await self.fail(scope, receive, send, error)
        except Exception as exc:  # noqa: BLE001 - logged; nothing else can reach this client
            self.relay.internal_error(f"{self.task}_fail", exc)

    async def _first_to_end(self, consumer: asyncio.Task[None], client_left: asyncio.Task[None],
                            reader: asyncio.Task[None]) -> None:
        """Returns when the consumer ends, the client leaves, or the reader gives up on a slow client
        (the reader ending normally only means the whole worker stream is queued: the consumer goes
        on). Done-callbacks on one future: lighter than `asyncio.wait`, and every open stream holds it."""
        ended = asyncio.get_running_loop().create_future()

        def end(task: asyncio.Task[None]) -> None:
            if not ended.done() and (task is not reader or self.relay.slow):
                ended.set_result(None)

        for task in (consumer, client_left, reader):
            task.add_done_callback(end)
        try:
            await ended
        finally:
            for task in (consumer, client_left, reader):
                task.remove_done_callback(end)
