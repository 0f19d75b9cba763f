"""An ASGI app served by uvicorn in a thread on a free loopback port, for tests that need a real socket."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import uvicorn


@contextlib.contextmanager
def serving(app: Any, *, lifespan: Literal["auto", "on", "off"] = "auto", timeout: float = 10.0) -> Iterator[str]:
    """The app's URL once uvicorn listens (within `timeout`); the server stops when the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
