"""Drain: the coordinator's graceful shutdown on SIGTERM (or the first Ctrl+C).

Owns: the order of a shutdown: stop admitting (new requests and queued ones get 503 `draining`,
health answers 503 `draining` so a load balancer moves away), let the streams in flight finish up to
`drain_timeout`, then end every stream still open with an `error` event (reason `draining`) and give
them a moment to reach their clients. Only then may the server close its connections and exit 0.
Must not: stop the server itself (server.py does, when `run` returns) or touch a worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from protocol import reasons

if TYPE_CHECKING:
    from coordinator.state import CoordinatorState

log = logging.getLogger("coordinator")
POLL = 0.05
FLUSH_TIMEOUT = 2.0  # for the `error` events of the streams ended at the deadline to reach their clients


async def run(state: CoordinatorState, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    state.draining = True
    state.queue.wake(None)  # queued requests try again, and are refused as draining
    running = len(state.streams)
    log.warning(json.dumps({"event": "draining", "streams": running, "timeout_s": timeout}))
    deadline = loop.time() + timeout
    while state.streams and loop.time() < deadline:
        await asyncio.sleep(POLL)
    ended = len(state.streams)
    for relay in list(state.streams):
        relay.abort(reasons.DRAINING, f"the coordinator is shutting down; the stream ran past its {timeout:g} s "
                    "drain deadline")
    flush_deadline = loop.time() + FLUSH_TIMEOUT
    while state.streams and loop.time() < flush_deadline:
        await asyncio.sleep(POLL)
    log.warning(json.dumps({"event": "drained", "streams_finished": running - ended, "streams_ended": ended,
                            "streams_left": len(state.streams)}))
