"""Runs one point of a sweep (one concurrency or one rate) against one target, and whole sweeps.

Owns: the HTTP connection pool of a point, the progress bar, the wall time, the run-wide request cap.
Must not: define metrics (stats.py) or print results (report.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx
from tqdm import tqdm

from bench.load.clients import StreamClient
from bench.load.record import RequestRecord
from bench.load.stats import Slo, Summary, summarize
from bench.load.workload import WorkItem, Workload, closed_loop, open_loop

Mode = Literal["closed", "open"]


@dataclass(frozen=True)
class Point:
    """One measurement: `level` users (closed loop) or requests/s (open loop), bounded by
    `requests` and/or `duration` seconds (whichever comes first)."""

    mode: Mode
    level: float
    requests: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        if self.requests is None and self.duration is None:
            raise ValueError("a point needs --requests or --duration to stop by itself")

    @property
    def label(self) -> str:
        return f"c={int(self.level)}" if self.mode == "closed" else f"rate={self.level:g}/s"


@dataclass
class PointResult:
    point: Point
    summary: Summary
    records: list[RequestRecord] = field(repr=False, default_factory=list)


class Runner:
    """Drives one target (a `StreamClient`) through points; `cap` bounds requests over all of them."""

    def __init__(self, client: StreamClient, workload: Workload, *, slo: Slo | None = None, cap: int = 10_000,
                 failure_pause: float = 0.05, progress: bool = True, clock: Callable[[], float] = time.perf_counter,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.client, self.workload, self.slo = client, workload, slo or Slo()
        self.remaining = cap
        self._progress = progress
        # A closed-loop user whose request failed waits this long before its next one: a refused
        # request returns at once, and without a pause the user would hot-loop the server with
        # thousands of rejections a second, stealing CPU from the requests it is serving.
        self.failure_pause = failure_pause
        self._clock = clock
        self._transport = transport

    def _http(self, connections: int | None) -> httpx.AsyncClient:
        timeout = self.client.timeout
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)), limits=limits,
                                 transport=self._transport, trust_env=False)

    async def warm_up(self, requests: int) -> list[RequestRecord]:
        """Unmeasured requests sent one at a time first (lazy start-up costs, caches); not capped."""
        items = Workload(self.workload.prompts, seed=self.workload.seed + 1).items(requests)
        async with self._http(1) as http:
            return [await self.client.send(http, item) for item in items]

    async def run(self, point: Point) -> PointResult:
        limit = min(point.requests if point.requests is not None else self.remaining, self.remaining)
        records: list[RequestRecord] = []
        bar = tqdm(total=limit if point.requests is not None else None, desc=point.label, unit="req",
                   disable=not self._progress, file=sys.stderr, leave=False, dynamic_ncols=True)
        connections = int(point.level) if point.mode == "closed" else None

        async with self._http(connections) as http:
            async def send(item: WorkItem) -> None:
                record = await self.client.send(http, item)
                records.append(record)
                bar.update(1)
                if not record.ok:
                    bar.set_postfix(errors=sum(1 for r in records if not r.ok), refresh=False)
                    if point.mode == "closed" and self.failure_pause > 0:
                        await asyncio.sleep(self.failure_pause)

            items = self.workload.items(limit)
            start = self._clock()
            if point.mode == "closed":
                stop_at = start + point.duration if point.duration is not None else None
                await closed_loop(send, items, int(point.level), stop_at=stop_at, clock=self._clock)
            else:
                await open_loop(send, items, self.workload.arrivals(point.level), duration=point.duration,
                                clock=self._clock)
            wall = self._clock() - start
        bar.close()
        self.remaining -= len(records)
        records.sort(key=lambda r: r.index)
        return PointResult(point, summarize(records, wall, self.slo), records)

    async def sweep(self, points: Sequence[Point],
                    on_point: Callable[[PointResult], None] | None = None) -> list[PointResult]:
        results = []
        for point in points:
            if self.remaining <= 0:
                print(f"request cap reached: skipping {point.label} and later points", file=sys.stderr)
                break
            result = await self.run(point)
            if on_point is not None:
                on_point(result)
            results.append(result)
        return results
