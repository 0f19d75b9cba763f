"""A 10x flood: a steady closed-loop workload keeps its served throughput while ten times as many
extra requests per second hammer the coordinator; everything answered is 200 or 503, no connection
breaks, and the coordinator's memory stays bounded.

The flood is open-loop (requests sent on a fixed schedule, whatever the answers) from its own process,
over raw keep-alive HTTP/1.1 connections: an httpx client costs several times the CPU per request,
and on a small machine the load generator would otherwise be what is measured. By default 4 s of
flood; `FAULTS_LONG=1` runs the long version (60 s), whose served-throughput bound is the tighter.

Also here, for the other fault cases: `closed_loop` (users that send, read to the end and send again).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.scale_bench import cpu_seconds, rss_kib
from tests.faults.pool import COORDINATOR_FLAGS, FaultPool, periodically, pid, pool_fixture
from tests.integration.streams import infer

pytestmark = [pytest.mark.model, pytest.mark.load, pytest.mark.solo, pytest.mark.anyio]
LONG_RUN = os.environ.get("FAULTS_LONG") == "1"
BASELINE_SECONDS = 20.0 if LONG_RUN else 4.0
FLOOD_SECONDS = 60.0 if LONG_RUN else 4.0
FLOOD_FACTOR = 10
# The target is 80% of the served rate. On the shared 2-core machine the ratio ranged from
# 0.82 to 0.99 over five runs of 10 s with nothing changed (docs/faults-figures.md); the long run asserts
# 70%, and the default 4 s flood (after 4 s of baseline; 5 and 6 s until 2026-11-28, when three runs
# gave 0.99 to 1.02), whose ratio moves more, 50%: a flood that made refusals expensive or
# starved admission fails either (it serves next to nothing). Every other check is an invariant.
SERVED_BOUND = 0.7 if LONG_RUN else 0.5
QUEUE_BASELINE_SECONDS = 10.0 if LONG_RUN else 2.0  # the queued variant, which only reports its rates
QUEUE_FLOOD_SECONDS = 60.0 if LONG_RUN else 3.0  # (its checks are invariants, whatever the length)
ABANDON_AFTER = 1.0  # seconds after its end that the flood waits for answers (the queued ones then abandoned)
KEEP_ALIVE_EXPIRY = 4.0  # an idle connection is not reused after this long (the coordinator closes at 5 s)
# A refused user tries again this much later: soon enough to keep its seat busy, late enough that the
# users do not become a second flood (at 0.05 s they sent 870 retries in 10 s).
RETRY_PAUSE = 0.2
# The pool: 2 workers of 4 sequences, one thread each; on a 2-core machine only one, so that the
# coordinator and the flood's own process have a core that the workers do not need (with both
# workers, the 0.35 core the flood and its refusals take came straight out of the workers' decode
# steps: 75-78% of the served rate, latency up 40%, a measure of the machine and not of the coordinator).
FLOOD_WORKERS = ("f1", "f2") if (os.cpu_count() or 1) > 2 else ("f1",)
USERS = 4 * len(FLOOD_WORKERS)  # one per sequence
BODY = {"prompt": "Say hi.", "max_tokens": 8, "ignore_eos": True}


# --- the steady users -----------------------------------------------------------------------------

@dataclass
class Tally:
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    done_times: list[float] = field(default_factory=list)  # time.monotonic() when each `done` arrived
    latencies: list[float] = field(default_factory=list)  # seconds from sending to `done`
    failures: list[str] = field(default_factory=list)  # broken connections, streams without `done`

    def done_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.done_times)


async def closed_loop(url: str, users: int, body: dict[str, Any], seconds: float, *,
                      retry_pause: float = 0.05) -> Tally:
    """`users` clients each send `body`, read the stream to its end and send again, for `seconds`;
    a 503 is retried after `retry_pause` (not Retry-After: the point is to keep the pool busy)."""
    tally = Tally()
    until = time.monotonic() + seconds

    async def user(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            sent = time.monotonic()
            try:
                result = await infer(client, url, body)
            except httpx.HTTPError as exc:
                tally.failures.append(repr(exc))
                continue
            tally.statuses[result.status] += 1
            if result.status == 200:
                if result.names and result.names[-1] == "done":
                    tally.done_times.append(time.monotonic())
                    tally.latencies.append(time.monotonic() - sent)
                else:
                    tally.failures.append(f"stream ended with {result.events[-1:]}")
            else:
                tally.reasons[result.body["reason"] if result.body else "?"] += 1
                await asyncio.sleep(retry_pause)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2 * users)) as client:
        await asyncio.gather(*(user(client) for _ in range(users)))
    return tally


# --- the flood ------------------------------------------------------------------------------------

@dataclass
class FloodResult:
    target_rate: float
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    connection_errors: list[str] = field(default_factory=list)
    streams_without_done: int = 0
    abandoned: int = 0  # requests still unanswered when the flood ended (queued), closed unanswered
    done_times: list[float] = field(default_factory=list)
    done_latencies: list[float] = field(default_factory=list)  # seconds from sending to `done`
    started: float = 0.0
    ended: float = 0.0
    cpu_s: float = 0.0  # the flood process's own CPU time

    @property
    def achieved_rate(self) -> float:
        return self.sent / max(1e-9, self.ended - self.started)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            name, value = line.split(b":", 1)
            headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
        raise ValueError(f"neither a length nor chunks: {head!r}")
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return status, headers, bytes(body)
        body += (await reader.readexactly(size + 2))[:-2]


async def _flood(port: int, rate: float, seconds: float, connections: int, ready: Any) -> FloodResult:
    payload = json.dumps(BODY).encode()
    request = (b"POST /coordinator/infer HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % (port, len(payload))) + payload
    result = FloodResult(rate)
    statuses: collections.Counter[int] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(connections)]
    ready.put("ready")
    result.started = start = time.monotonic()
    end = start + seconds
    tickets = itertools.count()

    async def connection(streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        """Sends on one keep-alive connection at the times of the tickets it takes; reconnects if the
        server closes it. Whatever way it ends (cancelled included), its connection is closed."""
        used = time.monotonic()
        try:
            while (due := start + next(tickets) / rate) < end:
                await asyncio.sleep(due - time.monotonic())
                if streams is not None and time.monotonic() - used > KEEP_ALIVE_EXPIRY:
                    streams[1].close()  # the server may be closing it: a client does not reuse it
                    streams = None
                used = time.monotonic()
                try:
                    if streams is None:
                        streams = await asyncio.open_connection("127.0.0.1", port)
                    streams[1].write(request)
                    result.sent += 1
                    sent = time.monotonic()
                    status, headers, body = await _read_response(streams[0])
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                    result.connection_errors.append(repr(exc))
                    if streams is not None:
                        streams[1].close()
                    streams = None
                    continue
                statuses[status] += 1
                if status == 200:
                    if b"event: done" in body:
                        result.done_times.append(time.monotonic())
                        result.done_latencies.append(time.monotonic() - sent)
                    else:
                        result.streams_without_done += 1
                else:
                    with contextlib.suppress(ValueError):
                        reasons[json.loads(body).get("reason", "?")] += 1
                if headers.get(b"connection", b"").lower() == b"close":
                    streams[1].close()
                    streams = None
        finally:
            if streams is not None:
                streams[1].close()

    tasks = [asyncio.create_task(connection(streams)) for streams in opened]
    _, late = await asyncio.wait(tasks, timeout=seconds + ABANDON_AFTER)
    for task in late:  # a request still waiting (in the admission queue) is abandoned, not counted
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    result.abandoned = len(late)
    result.ended = min(time.monotonic(), end)
    result.statuses, result.reasons = dict(statuses), dict(reasons)
    result.cpu_s = time.process_time()
    return result


def _flood_process(port: int, rate: float, seconds: float, connections: int, out: Any) -> None:
    out.put(asyncio.run(_flood(port, rate, seconds, connections, out)))


@contextlib.contextmanager
def flood(port: int, rate: float, seconds: float, connections: int) -> Iterator[Any]:
    """Runs the flood in its own process; yields once its connections are open and the flood has
    started. `.get()` on the yielded object returns its `FloodResult` once it is over."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(port, rate, seconds, connections, out), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=60) == "ready"
        yield out
    finally:
        proc.join(timeout=seconds + 60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def refusal_lines(path: Path) -> int:
    """Lines the coordinator logged for 503 answers."""
    return path.read_bytes().count(b'"status":503')


flood_pool = pool_fixture("flood", worker_ids=FLOOD_WORKERS)


async def run_flood(pool: FaultPool, rate: float, connections: int, seconds: float,
                    ) -> tuple[Tally, FloodResult, float, dict[str, float]]:
    """The users for `seconds` while the flood runs; returns what each saw, the window's start and
    the coordinator's RSS (KiB) before, at its peak and after, and the refusals it logged meanwhile."""
    log_path, coordinator = pool.log_dir / "coordinator.log", pid(pool.coordinator)
    lines_before, rss_before = refusal_lines(log_path), rss_kib(coordinator)
    cpu_before = cpu_seconds(coordinator)
    rss: list[int] = []  # every half second
    with (periodically(0.5, lambda: rss.append(rss_kib(coordinator))),
          flood(pool.port, rate, seconds + 1, connections) as out):
        window = time.monotonic()
        users = await closed_loop(pool.url, USERS, BODY, seconds, retry_pause=RETRY_PAUSE)
        result: FloodResult = await asyncio.to_thread(out.get, timeout=seconds + 120)
    memory = {"rss_before_kib": rss_before, "rss_peak_kib": max([rss_before, *rss]),
              "rss_after_kib": rss_kib(coordinator), "refusal_log_lines": refusal_lines(log_path) - lines_before,
              "coordinator_cpu_s": round(cpu_seconds(coordinator) - cpu_before, 2),
              "flood_process_cpu_s": round(result.cpu_s, 2)}
    return users, result, window, memory


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def test_a_10x_flood_is_answered_200_or_503_and_served_throughput_holds(
        flood_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    pool = flood_pool
    pool.ensure()
    # The baseline is measured in two halves, before and after the flood, so that a change in what
    # the rest of the machine does during the test weighs on both sides alike.
    before = await closed_loop(pool.url, USERS, BODY, BASELINE_SECONDS / 2, retry_pause=RETRY_PAUSE)
    rate = FLOOD_FACTOR * len(before.done_times) / (BASELINE_SECONDS / 2)
    users, result, window, memory = await run_flood(pool, rate, connections=64, seconds=FLOOD_SECONDS)
    after = await closed_loop(pool.url, USERS, BODY, BASELINE_SECONDS / 2, retry_pause=RETRY_PAUSE)
    baseline = Tally(before.statuses + after.statuses, before.reasons + after.reasons,
                     before.done_times + after.done_times, before.latencies + after.latencies,
                     before.failures + after.failures)
    assert baseline.failures == [] and set(baseline.statuses) <= {200, 503}, baseline
    served_without = len(baseline.done_times) / BASELINE_SECONDS
    served_with_users = users.done_between(window, window + FLOOD_SECONDS)
    served_with_flood = sum(window <= t <= window + FLOOD_SECONDS for t in result.done_times)
    served_with = (served_with_users + served_with_flood) / FLOOD_SECONDS
    figure = {
        "case": "10x flood", "flood_seconds": FLOOD_SECONDS, "workers": len(FLOOD_WORKERS), "users": USERS, "max_tokens": BODY["max_tokens"],
        "served_without_rps": round(served_without, 2), "served_with_rps": round(served_with, 2),
        "served_ratio": round(served_with / served_without, 3),
        "served_with_by_users_rps": round(served_with_users / FLOOD_SECONDS, 2),
        "flood_target_rps": round(rate, 1), "flood_sent_rps": round(result.achieved_rate, 1),
        "flood_statuses": result.statuses, "flood_reasons": result.reasons,
        "user_statuses": dict(users.statuses), "baseline_statuses": dict(baseline.statuses), "connection_errors": len(result.connection_errors) + len(users.failures),
        "user_latency_p50_s": round(percentile(users.latencies, 0.5), 3),
        "flood_200_latency_p50_s": round(percentile(result.done_latencies, 0.5), 3),
        "baseline_latency_p50_s": round(percentile(baseline.latencies, 0.5), 3),
        **memory}
    print("FIGURE", json.dumps(figure))
    figures.append(figure)
    # The flood really was 10x: otherwise nothing below would mean anything.
    assert result.achieved_rate >= 0.9 * rate, figure
    assert set(result.statuses) <= {200, 503} and set(users.statuses) <= {200, 503}, figure
    assert result.connection_errors == [] and users.failures == [], (result.connection_errors[:5], users.failures[:5])
    assert result.streams_without_done == 0
    # Memory is bounded: a flood of refusals leaves nothing behind per request.
    assert memory["rss_peak_kib"] - memory["rss_before_kib"] < 32 * 1024, memory
    # Refusals are logged at a bounded rate (20 a second by default), not one line each.
    assert memory["refusal_log_lines"] <= 20 * (FLOOD_SECONDS + 2) + 10, memory
    assert served_with >= SERVED_BOUND * served_without, figure


async def test_the_same_flood_with_the_admission_queue_on(flood_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    """With the default queue (256 places, 30 s) the flood waits in line instead of being refused at
    once: served throughput is the pool's either way, but the steady users wait behind the flood."""
    pool = flood_pool
    queued_flags = [f for f in COORDINATOR_FLAGS if f not in ("--queue-size", "0")]
    pool.restart_coordinator(queued_flags)
    try:
        baseline = await closed_loop(pool.url, USERS, BODY, QUEUE_BASELINE_SECONDS, retry_pause=RETRY_PAUSE)
        served_without = len(baseline.done_times) / QUEUE_BASELINE_SECONDS
        rate = FLOOD_FACTOR * served_without
        # Queued requests hold their connection: enough of them that the schedule is kept.
        users, result, window, memory = await run_flood(pool, rate, connections=512, seconds=QUEUE_FLOOD_SECONDS)
    finally:
        pool.restart_coordinator(list(COORDINATOR_FLAGS))
    by_users = users.done_between(window, window + QUEUE_FLOOD_SECONDS)
    served_with = (by_users + sum(window <= t <= window + QUEUE_FLOOD_SECONDS for t in result.done_times)
                   ) / QUEUE_FLOOD_SECONDS
    figure = {
        "case": "10x flood, admission queue 256", "flood_seconds": QUEUE_FLOOD_SECONDS,
        "served_without_rps": round(served_without, 2), "served_with_rps": round(served_with, 2),
        "served_ratio": round(served_with / served_without, 3),
        "served_with_by_users_rps": round(by_users / QUEUE_FLOOD_SECONDS, 2),
        "flood_target_rps": round(rate, 1), "flood_sent_rps": round(result.achieved_rate, 1),
        "flood_statuses": result.statuses, "flood_reasons": result.reasons, "flood_abandoned": result.abandoned,
        "user_statuses": dict(users.statuses), "connection_errors": len(result.connection_errors) + len(users.failures),
        "user_latency_p50_s": round(percentile(users.latencies, 0.5), 3),
        "user_latency_max_s": round(max(users.latencies, default=float("nan")), 3),
        "baseline_latency_p50_s": round(percentile(baseline.latencies, 0.5), 3), **memory}
    print("FIGURE", json.dumps(figure))
    figures.append(figure)
    assert set(result.statuses) <= {200, 503} and set(users.statuses) <= {200, 503}, figure
    assert result.connection_errors == [] and users.failures == [], (result.connection_errors[:5], users.failures[:5])
    assert result.streams_without_done == 0
    assert memory["rss_peak_kib"] - memory["rss_before_kib"] < 32 * 1024, memory
