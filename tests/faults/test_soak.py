"""A soak at moderate load: the coordinator's and the workers' resident memory and the KV cache in
use stay flat (memory within 5% either way between the second quarter of the run, after warm-up, and
the last; KV in use never more than the users' requests can hold at once), and
every session and KV cell is back to 0 at the end.

Moderate load: 4 users on the pool's 8 sequences, each sending a 32-token request and, one request
in four, hanging up after its fourth token (so the disconnect path runs as often as the normal end).
By default 20 s (it was 60 s: the invariants hold from the first requests on, and memory had settled
within the first quarter in every run); `FAULTS_LONG=1` runs the 10-minute version.

The workers' prompt cache in host memory (WORKER_HOST_CACHE_MIB) keeps each request's cells once the next
one takes its sequence, so it grows until its bound: 256 MiB by default, 16 MiB here, full within the first
quarter, so memory flat after it says nothing leaks beside it (at 256 MiB a worker grew 7.7% in 20 s).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import statistics
import time
from typing import Any

import httpx
import pytest

from bench.scale_bench import rss_kib
from tests.faults.conftest import since
from tests.faults.pool import WORKER_FLAGS, FaultPool, periodically, pid, pool_fixture
from tests.integration.streams import infer

pytestmark = [pytest.mark.model, pytest.mark.load, pytest.mark.anyio]
LONG_RUN = os.environ.get("FAULTS_LONG") == "1"
SOAK_SECONDS = 600.0 if LONG_RUN else 20.0
USERS = 4
MAX_TOKENS = 32
BODY = {"prompt": "Describe a walk by the sea.", "max_tokens": MAX_TOKENS, "ignore_eos": True}
HANG_UP_EVERY = 4
KV_EVERY, RSS_EVERY = 0.5, 1.0  # seconds between samples
FLAT = 0.05
PROMPT_TOKENS_BOUND = 64  # BODY's prompt with the chat template's system prompt: about 30 tokens
HOST_CACHE_MIB = 16

soak_pool = pool_fixture("soak", worker_flags=[*WORKER_FLAGS, "--host-cache-mib", str(HOST_CACHE_MIB)])


@pytest.fixture
def fault_pool(soak_pool: FaultPool) -> FaultPool:
    soak_pool.ensure()
    return soak_pool


def saved_bytes(pool: FaultPool) -> float:
    """Bytes the workers' prompt caches saved to host memory so far."""
    name = "worker_host_cache_saved_bytes_total "
    return sum(float(line.rsplit(" ", 1)[1]) for url in pool.worker_urls.values()
               for line in httpx.get(url + "/metrics", timeout=5).text.splitlines() if line.startswith(name))


class Sampler:
    """KV in use on the workers at each `sample()`, and resident memory of every process every RSS_EVERY."""

    def __init__(self, pool: FaultPool) -> None:
        self.pool = pool
        self.pids = {"coordinator": pid(pool.coordinator), **{w: pid(p) for w, p in pool.workers.items()}}
        self.kv: list[tuple[float, int]] = []
        self.rss: dict[str, list[tuple[float, int]]] = {name: [] for name in self.pids}
        self._next_rss = 0.0

    def sample(self) -> None:
        now = time.monotonic()
        try:
            self.kv.append((now, sum(self.pool.worker_load(w)["kv_used_bytes"] for w in self.pool.workers)))
        except (httpx.HTTPError, ValueError):
            pass  # a sample lost to a busy moment; the next one counts
        if now >= self._next_rss:
            for name, process in self.pids.items():
                self.rss[name].append((now, rss_kib(process)))
            self._next_rss = now + RSS_EVERY


def quarter_means(series: list[tuple[float, int]], start: float, length: float) -> tuple[float, float]:
    """The mean over the run's second quarter and over its last quarter."""
    second = [v for t, v in series if start + length / 4 <= t < start + length / 2]
    last = [v for t, v in series if t >= start + 3 * length / 4]
    assert second and last, f"too few samples: {len(second)}, {len(last)}"
    return statistics.fmean(second), statistics.fmean(last)


async def test_memory_and_kv_stay_flat_and_return_to_zero(fault_pool: FaultPool, figures: list[dict[str, Any]]) -> None:
    pool = fault_pool
    statuses: collections.Counter[int] = collections.Counter()
    ends: collections.Counter[str] = collections.Counter()
    until = time.monotonic() + SOAK_SECONDS

    async def user(client: httpx.AsyncClient) -> None:
        sent = 0
        while time.monotonic() < until:
            sent += 1
            hang_up = sent % HANG_UP_EVERY == 0
            result = await infer(client, pool.url, BODY, stop_after_tokens=4 if hang_up else None)
            statuses[result.status] += 1
            if result.status != 200:
                await asyncio.sleep(0.2)
            elif hang_up:
                ends["hung_up"] += 1
            else:
                ends[result.names[-1] if result.names else "nothing"] += 1

    sampler = Sampler(pool)
    with periodically(KV_EVERY, sampler.sample):
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(user(client) for _ in range(USERS)))
        length = time.monotonic() - started
    ended = time.monotonic()
    still_held = pool.held()
    while still_held and time.monotonic() - ended < 10:
        await asyncio.sleep(0.1)
        still_held = pool.held()

    saved_mib = round(saved_bytes(pool) / 2**20, 1)
    flat = {name: quarter_means(series, started, length) for name, series in sampler.rss.items()}
    flat["kv_used"] = quarter_means(sampler.kv, started, length)
    change = {name: round(last / second - 1, 4) if second else 0.0 for name, (second, last) in flat.items()}
    figure = {"case": "soak", "seconds": round(length, 1), "users": USERS, "statuses": dict(statuses),
              "ends": dict(ends), "requests_per_s": round(sum(statuses.values()) / length, 2),
              "kv_samples": len(sampler.kv),
              "rss_kib_second_quarter": {n: round(v[0]) for n, v in flat.items() if n != "kv_used"},
              "rss_kib_last_quarter": {n: round(v[1]) for n, v in flat.items() if n != "kv_used"},
              "kv_used_bytes_mean_second_quarter": round(flat["kv_used"][0]),
              "kv_used_bytes_mean_last_quarter": round(flat["kv_used"][1]),
              "change_last_vs_second_quarter": change, "back_to_zero_s": since(ended),
              "host_cache_saved_mib": saved_mib}
    print("FIGURE", json.dumps(figure))
    figures.append(figure)
    assert set(statuses) <= {200, 503} and ends["nothing"] == ends["error"] == 0, figure
    assert not still_held, f"still held 10 s after the soak: {still_held}"
    # The cache was used past its bound on both workers together (its entries then replace one another).
    assert saved_mib > HOST_CACHE_MIB, figure
    # Memory within the band either way. KV in use is not held to a band: with 4 users its mean is a
    # few requests' tokens (about 110 at 22.5 KiB each) and follows how many happen to be in flight at
    # each sample: it moved -6.9%, -6.5% and +18.5% between quarters in three full runs, none of them a
    # leak. A leak accumulates, so the KV in use is bounded by what the users' requests can hold at
    # once, at every sample; and `still_held` above checks every cell is back at 0 at the end.
    assert all(abs(c) <= FLAT for name, c in change.items() if name != "kv_used"), change
    bytes_per_token = pool.worker_load(next(iter(pool.workers)))["bytes_per_token"]
    in_flight_bound = USERS * (PROMPT_TOKENS_BOUND + MAX_TOKENS) * bytes_per_token
    assert max(kv for _, kv in sampler.kv) <= in_flight_bound, (max(kv for _, kv in sampler.kv), in_flight_bound)
