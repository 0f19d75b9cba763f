"""Runs a batch: the jobs not done yet, at most `concurrency` at a time, each result appended as it ends.

Owns: which jobs a run sends (resumption), the lanes that run them, the HTTP client they share, and
stopping early when the pool refuses the credentials (every later job would be refused the same way).
Must not: parse the jobs file, draw, or decide retries (`jobs`, `progress`, `retry` do).

Concurrency is `concurrency` lanes over one iterator of jobs: no queue, so nothing is buffered
beyond the jobs list itself, and the HTTP client's connection pool is the same size.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from client.jobs import Job
from client.progress import BatchStats
from client.results import JobError, Result, ResultWriter, compact, completed_keys
from client.retry import RetryPolicy
from client.stream import run_job

# Statuses that no retry or other job can cure: the batch stops sending.
FATAL_STATUSES = frozenset({401, 403})
CLIENT_ERROR = "client_error"


@dataclass(frozen=True)
class BatchConfig:
    url: str
    output: Path
    concurrency: int = 4
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    api_key: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 120.0  # silence on a stream; the pool pings every 15 s
    attempt_timeout: float = 600.0  # one attempt, sending to the end of its stream

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")


@dataclass(frozen=True)
class BatchOutcome:
    sent: int  # jobs this run sent
    ok: int
    failed: int
    aborted: str | None  # why the run stopped before sending every job, if it did
    compacted: bool


def pending_jobs(jobs: list[Job], output: Path) -> list[Job]:
    """The jobs `output` holds no successful result for, in file order."""
    done = completed_keys(output)
    return [job for job in jobs if job.key not in done]


def http_client(config: BatchConfig, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    headers = {"accept": "text/event-stream"}
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout, write=config.connect_timeout,
                            pool=config.connect_timeout)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    return httpx.AsyncClient(base_url=config.url.rstrip("/"), headers=headers, timeout=timeout, limits=limits,
                             transport=transport)


async def run_batch(jobs: list[Job], config: BatchConfig, stats: BatchStats, *,
                    transport: httpx.AsyncBaseTransport | None = None,
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> BatchOutcome:
    """Sends `jobs` (already filtered by `pending_jobs`) and appends a line per result to the output."""
    todo = iter(jobs)
    sent = ok = failed = 0
    aborted: str | None = None

    async def lane(client: httpx.AsyncClient, writer: ResultWriter) -> None:
        nonlocal sent, ok, failed, aborted
        for job in todo:
            if aborted is not None:
                return
            sent += 1
            try:
                result = await run_job(client, job, config.policy, stats, attempt_timeout=config.attempt_timeout,
                                       sleep=sleep, clock=clock)
            except Exception as exc:  # noqa: BLE001 - a bug met by one job fails that job, not the batch
                traceback.print_exc()
                result = Result(job, attempts=1, error=JobError(CLIENT_ERROR, f"the client failed: {exc!r}"))
            writer.write(result)
            stats.finished(result)
            if result.ok:
                ok += 1
            else:
                failed += 1
                if result.error is not None and result.error.status in FATAL_STATUSES and aborted is None:
                    aborted = f"the pool refused the credentials: {result.error.message}"

    compacted = False
    try:
        async with http_client(config, transport) as client:
            with ResultWriter(config.output) as writer:
                async with asyncio.TaskGroup() as group:
                    for _ in range(min(config.concurrency, len(jobs))):
                        group.create_task(lane(client, writer))
    finally:
        stats.end()
        if config.output.exists():
            compacted = compact(config.output)
    return BatchOutcome(sent, ok, failed, aborted, compacted)
