"""Named routing policies with a real coordinator and the cluster's two real workers (registered by
hand, so this coordinator's view changes only by what the test does)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from protocol.health import Heartbeat, WorkerLoad
from tests.integration.conftest import TOKEN, Cluster, Proc, start_coordinator
from tests.integration.streams import infer

pytestmark = [pytest.mark.model, pytest.mark.anyio]
BODY = {"prompt": "Say hi.", "max_tokens": 3}


@pytest.fixture
def with_policy(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    proc, url = start_coordinator(tmp_path, f"coordinator-{request.param}", "--worker-token", TOKEN, "--heartbeat-interval", "60",
                                  "--routing-policy", request.param, "--queue-size", "0")
    try:
        for worker_id, worker_url in cluster.worker_urls.items():
            health = httpx.get(worker_url + "/worker/health", timeout=5).json()
            beat = Heartbeat(worker_id=worker_id, url=worker_url, model=health["model"],
                             aliases=health["aliases"], load=WorkerLoad(**health["load"]), timestamp=time.time())
            assert httpx.post(url + "/coordinator/health/heartbeat", content=beat.model_dump_json(), headers={"authorization": f"Bearer {TOKEN}"},
                              timeout=5).is_success
        yield url
    finally:
        Proc.stop(proc)


@pytest.mark.parametrize("with_policy", ["round-robin"], indirect=True)
def test_round_robin_alternates(with_policy: str) -> None:
    served = [httpx.post(with_policy + "/coordinator/infer", json=BODY, timeout=60).headers["x-worker-id"]
              for _ in range(6)]
    assert served == ["w1", "w2"] * 3
    listing = httpx.get(with_policy + "/coordinator/health/workers", timeout=5).json()
    assert listing["routing_policy"] == "round-robin"


@pytest.mark.parametrize("with_policy", ["least-connections"], indirect=True)
async def test_least_connections_follows_in_flight_streams(with_policy: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        long = asyncio.create_task(infer(client, with_policy, {"prompt": "Count.", "max_tokens": 200,
                                                               "ignore_eos": True}))
        for _ in range(100):
            listing = (await client.get(with_policy + "/coordinator/health/workers")).json()["workers"]
            busy = [w["worker_id"] for w in listing if w["in_flight"]]
            if busy:
                break
            await asyncio.sleep(0.02)
        assert len(busy) == 1
        # While that stream runs, every short request goes to the other worker, whatever the heartbeats say.
        short = [await infer(client, with_policy, BODY) for _ in range(3)]
        assert {s.headers["x-worker-id"] for s in short} == {"w1", "w2"} - set(busy)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of the process (affinity is per thread; llama.cpp computes in its own)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


@pytest.mark.solo  # its CPU hog would slow the other tests, and their load its workers
@pytest.mark.parametrize("with_policy", ["least-latency"], indirect=True)
def test_least_latency_moves_traffic_away_from_a_worker_slowed_by_a_cpu_hog(cluster: Cluster,
                                                                            with_policy: str) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.fail("this test pins the two workers to two different cores")
    pids = {w: cluster.workers[w].popen.pid for w in ("w1", "w2")}  # type: ignore[union-attr]
    # Two busy loops on w1's core leave it a third of the core: slowed well past what the rest of a
    # busy test run does to w2's (one loop left it half, too close to that noise in one full run).
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        pin(pids["w1"], {0})
        for hog in hogs:
            pin(hog.pid, {0})  # w1 now shares its core with busy loops
        pin(pids["w2"], {1})
        # A new prompt each time (no worker holds it: each is prefilled whole, where the hog hurts).
        served = [httpx.post(with_policy + "/coordinator/infer", timeout=60, json={
            "prompt": f"Request {i}. " + "Describe the sea in a long sentence, with many words. " * 12,
            "max_tokens": 2}).headers["x-worker-id"] for i in range(12)]
        listing = httpx.get(with_policy + "/coordinator/health/workers", timeout=5).json()["workers"]
        latencies = {w["worker_id"]: w["ttft_ewma_ms"] for w in listing}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(5)
        every = set(range(os.cpu_count() or 1))
        for pid in pids.values():
            pin(pid, every)
    # Both are measured once; then the slowed one gets a request only when its average has decayed
    # (half-life 10 s) below the other's: most go to w2 (7 of 10 in the runs while writing this).
    assert served[2:].count("w2") >= 6, (served, latencies)
