"""`llm-coordinator` / `python -m coordinator`: read settings, set up logging, serve with uvicorn.

Owns: the process entry point. Must not: hold any logic the tests need (that is in create_app).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Awaitable

import uvicorn

from coordinator.app import create_app, edge_limits
from coordinator.ops import drain
from coordinator.server import CoordinatorServer, DropAbandonedResponse, bounded_protocol
from coordinator.settings import Settings
from serving.server import DrainingServer
from serving.tracing import Tracing, TracingError


def main(argv: list[str] | None = None) -> None:
    settings = Settings.load(os.environ, sys.argv[1:] if argv is None else argv)
    level = settings.log_level.upper()
    # Request lines are JSON objects already: print them as they are, one per line.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    requests_log = logging.getLogger("coordinator.requests")
    requests_log.addHandler(handler)
    requests_log.setLevel(level)
    requests_log.propagate = False
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tracing = Tracing.from_env("llm-pool-coordinator")
    except TracingError as exc:
        raise SystemExit(f"coordinator: {exc}") from None
    app = create_app(settings, tracing=tracing)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        http=bounded_protocol(settings.client_send_buffer_bytes, edge_limits(settings)), access_log=False,
        timeout_graceful_shutdown=5, proxy_headers=False, limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_timeout)  # nothing here reads the client's address
    # After Config: it applies uvicorn's logging config, which would not keep a filter added before.
    logging.getLogger("uvicorn.error").addFilter(DropAbandonedResponse())
    now, later = listening(settings)

    def run_drain() -> Awaitable[None]:
        return drain.run(app.state.coordinator, settings.drain_timeout)

    server = DrainingServer(config, run_drain) if later is None else CoordinatorServer(
        config, run_drain, shared=later, readiness=lambda: app.state.coordinator.readiness)
    server.run(sockets=now)


def listening(settings: Settings) -> tuple[list[socket.socket] | None, socket.socket | None]:
    """The sockets to serve at once (None: uvicorn binds `port` itself), and the shared port's, to
    serve once the pool is known (CoordinatorServer): only when `port` is shared with other
    coordinator processes (SO_REUSEPORT) and this one has a port of its own, where workers reach it
    first. Without a port of its own it could hear from no worker before joining, so it joins at once."""
    if not settings.reuse_port and not settings.own_port:
        return None, None
    if settings.reuse_port and settings.own_port:
        # Bound now, so a port taken by another program stops the start; listening only once joined.
        shared = bind(settings.host, settings.port, reuse_port=True, listen=False)
        return [bind(settings.host, settings.own_port)], shared
    shared = bind(settings.host, settings.port, reuse_port=settings.reuse_port)
    return ([shared, bind(settings.host, settings.own_port)] if settings.own_port else [shared]), None


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:  # a bound socket that does not listen takes no connection, even in a SO_REUSEPORT group
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    main()
