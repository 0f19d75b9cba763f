"""The uvicorn pieces: the bounded send buffer and the log filter that go with slow-client cut-offs."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import uvicorn

from coordinator.server import DropAbandonedResponse, bounded_protocol


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, None, None)


def test_only_the_abandoned_response_line_is_dropped() -> None:
    keep = DropAbandonedResponse()
    assert not keep.filter(record("ASGI callable returned without completing response."))
    assert keep.filter(record("Exception in ASGI application"))


async def _app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    await asyncio.Event().wait()


@pytest.mark.anyio
@pytest.mark.parametrize("size", [6000, 0])
async def test_accepted_connections_get_the_bounded_send_buffer(size: int) -> None:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, http=bounded_protocol(size), lifespan="off",
                            log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not server.server_state.connections:
            await asyncio.sleep(0.01)
        transport = next(iter(server.server_state.connections)).transport
        sndbuf = transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        high = transport.get_write_buffer_limits()[1]
        if size:
            assert sndbuf == 2 * size and high == size  # Linux doubles the value it is given
        else:
            assert high == 64 * 1024  # asyncio's default, untouched
        writer.close()
    finally:
        server.should_exit = True
        server.force_exit = True
        await asyncio.wait_for(serving, timeout=5)


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_an_event_stream_head_goes_out_with_its_first_event() -> None:
    from coordinator.server import _CoalescingTransport

    real = _Recorder()
    transport = _CoalescingTransport(real)
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\r\n")
    assert real.writes == []
    transport.write(b"1e\r\nevent: token\r\n...")
    transport.write(b"more")
    assert real.writes == [(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\r\n"
                           b"1e\r\nevent: token\r\n..."), b"more"]
    assert transport.is_closing() is False  # everything else reaches the real transport


def test_other_responses_are_written_at_once_and_close_flushes() -> None:
    from coordinator.server import _CoalescingTransport

    real = _Recorder()
    transport = _CoalescingTransport(real)
    transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\r\n")
    assert len(real.writes) == 1
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    transport.close()
    assert len(real.writes) == 2 and real.closed
