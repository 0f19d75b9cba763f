"""`llm-coordinator` / `python -m coordinator`: read settings, set up logging, serve with uvicorn.

Owns: the process entry point. Must not: hold any logic the tests need (that is in create_app).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import uvicorn

from coordinator.app import create_app, edge_limits
from coordinator.ops import drain
from coordinator.server import DropAbandonedResponse, bounded_protocol
from coordinator.settings import Settings
from serving.server import DrainingServer


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
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        http=bounded_protocol(settings.client_send_buffer_bytes, edge_limits(settings)), access_log=False,
        timeout_graceful_shutdown=5, proxy_headers=False, limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_timeout)  # nothing here reads the client's address
    # After Config: it applies uvicorn's logging config, which would not keep a filter added before.
    logging.getLogger("uvicorn.error").addFilter(DropAbandonedResponse())
    server = DrainingServer(config, lambda: drain.run(app.state.coordinator, settings.drain_timeout))
    server.run(sockets=listening(settings))


def listening(settings: Settings) -> list[socket.socket] | None:
    """The sockets to serve: None (uvicorn binds `port` itself) unless `port` is shared with other
    coordinator processes (SO_REUSEPORT) or this process has a port of its own besides."""
    if not settings.reuse_port and not settings.own_port:
        return None
    shared = bind(settings.host, settings.port, reuse_port=settings.reuse_port)
    return [shared, bind(settings.host, settings.own_port)] if settings.own_port else [shared]


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    main()
