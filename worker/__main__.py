"""`python -m worker` / `llm-worker`: runs one worker with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from worker.app import create_app
from worker.settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = WorkerSettings.load(argv)
    except ValidationError as exc:
        print(f"llm-worker: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings)
    # No Date or Server header: only the coordinator reads a worker's responses, and it keeps the
    # parsed headers of every open stream for as long as the stream lasts.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, timeout_graceful_shutdown=5, date_header=False, server_header=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
