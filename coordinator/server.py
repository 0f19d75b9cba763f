"""Serving the app with uvicorn: a bounded send buffer on every client connection, and an event
stream's head sent in the same segment as its first event.

Owns: the uvicorn protocol class and the log filter that go with the relay's slow-client cut-off, and
the shared port's joining and leaving (`CoordinatorServer`).
Must not: build the app or read settings beyond what it is given.

Why bound the send buffer: a client that stops reading should fill its relay buffer (where the
write deadline sees it) within a few dozen events. Left alone, Linux autotunes a loopback socket's
send buffer to megabytes and asyncio's transport holds 64 KiB more, so thousands of tokens would
vanish into buffers before the coordinator noticed. SSE token events are ~100 bytes, so 32 KiB is
plenty for a reading client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools is a dependency

from serving.edge import EdgeLimits, guarded_protocol
from serving.server import DrainingServer

if TYPE_CHECKING:
    from coordinator.pool.readiness import Readiness

log = logging.getLogger("coordinator")


class _CoalescingTransport:
    """Holds an event-stream response's head until its next write, so one TCP segment carries the
    status line, the headers and the first token: the client wakes once for its first token instead
    of twice (measured: about 0.5 ms of time to first token on this project's 2-core machine).
    Safe because the coordinator's only event stream (response.py) sends its head only once its
    first event is in hand and writes that event right after."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        elif data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data:
            self._held = data
            return
        self._transport.write(data)

    def close(self) -> None:
        if self._held:
            self._transport.write(self._held)
            self._held = b""
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_protocol(send_buffer_bytes: int, limits: EdgeLimits | None = None) -> type[asyncio.Protocol]:
    """The coordinator's protocol: this send buffer, and the edge limits (serving/edge.py) when given."""

    class BoundedSendProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]  # a proxy
            if send_buffer_bytes <= 0:
                return
            sock = transport.get_extra_info("socket")  # the real transport's
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            transport.set_write_buffer_limits(high=send_buffer_bytes)

    return BoundedSendProtocol if limits is None else guarded_protocol(limits, BoundedSendProtocol)


class DropAbandonedResponse(logging.Filter):
    """A slow client's stream is abandoned on purpose (response.py) and logged by the coordinator
    as `slow_consumer`; uvicorn's generic error line for it would only be noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."



class CoordinatorServer(DrainingServer):
    """A coordinator process that shares its port with siblings (REUSE_PORT) and has a port of its own.

    It serves its own port (heartbeats, metrics) from the start, and listens on the shared port only
    once `readiness` says it knows the pool (coordinator/pool/readiness.py): until then the kernel
    spreads no client connection to it, and its siblings serve them all. Measured before this: a
    coordinator restarted by start.sh took its share of connections at once, and 18 of 20 requests
    one second after the kill were refused `no_workers`.

    On drain it leaves the shared port at once: the listening socket is closed, so new connections go
    to the siblings; idle keep-alive connections are closed, so a client's pool opens a new one
    (to a sibling) instead of reusing them; a request in progress finishes on its connection, which
    then closes. Before this, a draining process kept its socket in the port group, and half of the
    new requests during its drain got `503 draining`. A connection the kernel queued to it in the
    instant before the close is reset (Linux migrates such connections only with the
    net.ipv4.tcp_migrate_req sysctl).
    """

    def __init__(self, config: Any, drain: Any, *, shared: socket.socket, readiness: Callable[[], Readiness]) -> None:
        super().__init__(config, drain)
        self._shared = shared
        self._readiness = readiness
        self._joining: asyncio.Task[None] | None = None
        self._joined: asyncio.Server | None = None
        self._left = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._joining = asyncio.get_running_loop().create_task(self._join())
        self._joining.add_done_callback(self._joined_or_failed)

    async def _join(self) -> None:
        await self._readiness().until_known()
        if self._left:
            return
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]  # uvicorn's own factory, as in startup
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop)

        server = await asyncio.get_running_loop().create_server(create_protocol, sock=self._shared,
                                                                 backlog=config.backlog)
        self._joined = server
        self.servers.append(server)  # closed with the others at shutdown
        self._readiness().joined()
        log.info(json.dumps({"event": "joined_port", "port": self._shared.getsockname()[1]}))

    def _joined_or_failed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("joining the shared port failed; stopping", exc_info=task.exception())
            self.should_exit = True

    def before_drain(self) -> None:
        self._left = True
        if self._joining is not None and not self._joining.done():
            self._joining.cancel()
        if self._joined is None:
            self._shared.close()
            return
        self._joined.close()  # stops listening: the kernel sends new connections to the siblings
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle: closed now; busy: closed once its response is complete
        log.warning(json.dumps({"event": "left_port", "port": self.config.port,
                                "connections_busy": len(self.server_state.connections)}))
