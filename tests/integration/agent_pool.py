"""A pool as `./start.sh` runs it for the agents' tests: a coordinator and one worker with the workers'
default KV layout (split: a freed sequence keeps its tokens, so a next turn reuses its prefix; the shared
cluster of conftest.py runs a unified KV, which keeps none), and whatever worker flags a test needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.integration.conftest import start_coordinator, start_worker, stop_all
from tests.polling import wait_until


def _alive(url: str) -> bool:
    listing = httpx.get(url + "/coordinator/health/workers", timeout=2).json()["workers"]
    return any(w["state"] == "alive" for w in listing)


@contextlib.contextmanager
def agent_pool(log_dir: Path, model_path: Path, *worker_flags: str) -> Iterator[str]:
    """The coordinator's URL, its worker alive; both stopped however the block ends."""
    coordinator, url = start_coordinator(log_dir, "coordinator")
    procs = [coordinator]
    try:
        worker, _ = start_worker(log_dir, "w1", url, model_path, "--threads", "1", *worker_flags)
        procs.append(worker)
        wait_until(lambda: _alive(url), 90, "the worker to be alive", interval=0.2)
        yield url
    finally:
        stop_all(reversed(procs))
