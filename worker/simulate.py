"""`python -m worker.simulate`: many SIMULATED workers (no model) in one process, for coordinator benchmarks.

Each simulated worker is a full worker app (same API, admission, KV accounting, heartbeats) with the
simulated engine, on its own port, all sharing one event loop. Example: 100 workers on 4001..4100
heartbeating to a coordinator on 1337, 50 tokens/s per stream:

    python -m worker.simulate --workers 100 --base-port 4001 --coordinator-url http://127.0.0.1:1337
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn
import uvloop

from worker.api.app import create_app
from worker.settings import WorkerSettings


def settings_for(index: int, args: argparse.Namespace) -> WorkerSettings:
    port = args.base_port + index
    return WorkerSettings(
        engine="simulated", port=port, worker_id=f"sim-{port}", coordinator_url=args.coordinator_url,
        worker_token=args.worker_token, heartbeat_interval=args.heartbeat_interval,
        max_sessions=args.max_sessions, session_max_tokens=args.session_max_tokens,
        sim_token_rate=args.token_rate, stream_buffer=args.stream_buffer, log_level="warning",
        embeddings=False)  # no embedder thread for each of hundreds of workers in one process


async def serve_all(args: argparse.Namespace) -> None:
    servers = []
    for i in range(args.workers):
        settings = settings_for(i, args)
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port,
                                log_level="warning", access_log=False, lifespan="on", date_header=False,
                                server_header=False)  # as the real worker (worker/__main__.py)
        servers.append(uvicorn.Server(config))
    await asyncio.gather(*(server.serve() for server in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--base-port", type=int, default=4001)
    parser.add_argument("--coordinator-url", default="http://127.0.0.1:1337")
    parser.add_argument("--worker-token", default="")
    parser.add_argument("--heartbeat-interval", type=float, default=10.0)
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--session-max-tokens", type=int, default=2048)
    parser.add_argument("--token-rate", type=float, default=50.0, help="tokens/s per stream")
    parser.add_argument("--stream-buffer", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(serve_all(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
