"""A real worker (uvicorn + the real model) in a background thread of the test process.

Tests talk to it over loopback HTTP like the coordinator does, and can also reach its runtime
(for reads of llama.cpp's own state through `Engine.call`).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.conftest import MODEL_THREADS, free_port
from worker.api.app import create_app
from worker.backends.llama_model import Model
from worker.runtime import WorkerRuntime
from worker.settings import WorkerSettings


class RunningWorker:
    def __init__(self, settings: WorkerSettings, app: Any, server: uvicorn.Server,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.app = app
        self.server = server
        self.loop = loop  # the server's event loop, for coroutines that must run beside it
        self.url = f"http://127.0.0.1:{settings.port}"

    @property
    def runtime(self) -> WorkerRuntime:
        return self.app.state.slots[0].runtime

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/worker/health", timeout=5).json()

    def load(self) -> dict[str, Any]:
        return self.health()["load"]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@functools.cache
def shared_model(path: Path) -> Model:
    """One load of a model file for the whole test process: every in-thread worker of the real model
    uses it (each with a context of its own), as one worker process does. Loading it took about as
    long as many of the tests that use it. Left open until the process ends."""
    return Model(path)


@contextmanager
def running_worker(model_path: Any, *, transport: httpx.AsyncBaseTransport | None = None,
                   **overrides: Any) -> Iterator[RunningWorker]:
    """`transport`: where the worker's own HTTP calls (heartbeats) go; the network if None. The real
    model is the process's `shared_model` unless the settings load it otherwise (GPU layers)."""
    values: dict[str, Any] = {"model_path": model_path, "port": free_port(), "coordinator_url": "", "threads": MODEL_THREADS,
                                  "max_sessions": 8, "session_max_tokens": 512, "log_level": "warning"}
    values.update(overrides)
    settings = WorkerSettings(**values)
    shared = settings.engine == "llama" and settings.gpu_layers < 0 and Path(settings.model_path).is_file()
    app = create_app(settings, model=shared_model(Path(settings.model_path)) if shared else None,
                     transport=transport)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                                           lifespan="on"))
    loops: queue.Queue[asyncio.AbstractEventLoop] = queue.Queue(1)

    def serve() -> None:
        # A Runner, like asyncio.run, cancels what is left and closes the loop when serve() returns.
        with asyncio.Runner() as runner:
            loops.put(runner.get_loop())
            runner.run(server.serve())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    worker = RunningWorker(settings, app, server, loops.get(timeout=10))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(worker.url + "/worker/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        server.should_exit = True
        raise RuntimeError("worker did not become healthy within 60 s")
    try:
        yield worker
    finally:
        server.should_exit = True
        thread.join(timeout=15)
