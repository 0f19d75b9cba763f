"""`python -m worker` / `llm-worker`: runs one worker with uvicorn."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from protocol.worker import SESSIONS_PATH
from serving.edge import EdgeLimits, guarded_protocol
from serving.server import DrainingServer
from serving.tracing import Tracing, TracingError
from worker.api.app import create_app
from worker.api.slots import loaded
from worker.backends import backends
from worker.sessions.records import Records
from worker.settings import WorkerSettings, slot_prefix

log = logging.getLogger("worker")
RECORDS_GRACE = 2.0  # seconds a drain waits for a coordinator to take its stored responses, after the last take


def main(argv: list[str] | None = None) -> int:
    engines = list(backends())
    try:
        settings = WorkerSettings.load(argv, engines=engines)
    except ValidationError as exc:
        print(f"llm-worker: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if settings.engine not in engines:  # from the environment, which argparse's choices do not see
        print(f"llm-worker: invalid settings: engine {settings.engine!r} is none of {', '.join(engines)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        tracing = Tracing.from_env("llm-pool-worker")
    except TracingError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, on_load_failure=lambda: os.kill(os.getpid(), signal.SIGTERM), tracing=tracing)
    # No Date or Server header: only the coordinator reads a worker's responses, and it keeps the
    # parsed headers of every open stream for as long as the stream lasts.
    limits = EdgeLimits(max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes,
                        max_headers=settings.max_headers, header_timeout=settings.header_timeout,
                        body_timeout=settings.body_timeout,
                        prefix_body_limits={slot_prefix(k) + SESSIONS_PATH + "/": settings.kv_transfer_max_bytes
                                            for k in range(settings.max_models)})
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=5, date_header=False, server_header=False,
                            http=guarded_protocol(limits), limit_concurrency=settings.max_connections)
    DrainingServer(config, lambda: _drain(app, settings.drain_timeout)).run()
    if getattr(app.state, "load_error", None):
        print(f"llm-worker: the model could not be loaded: {app.state.load_error}", file=sys.stderr)
        return 1
    return 0


async def _drain(app: FastAPI, timeout: float) -> None:
    # Every model served drains at once (none while still loading: nothing to finish).
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(runtime.drain(timeout) for runtime in loaded(app)))
    await _hand_records_over(app.state.records, started + timeout)


async def _hand_records_over(records: Records, deadline: float) -> None:
    """Stored responses are the coordinators' to move (coordinator/pool/records.py: they see `draining`
    in the heartbeats and take them): wait while they do, up to the drain's deadline, and no longer
    than RECORDS_GRACE after the last take (or the drain's end, when no coordinator takes any)."""
    loop = asyncio.get_running_loop()
    waited_from = time.monotonic()
    while len(records) and loop.time() < deadline:
        if time.monotonic() - max(waited_from, records.taken_at) > RECORDS_GRACE:
            break
        await asyncio.sleep(0.05)
    if len(records):
        log.warning(json.dumps({"event": "responses_not_handed_over", "records": len(records)}))


if __name__ == "__main__":
    raise SystemExit(main())
