"""The response cache with a real coordinator and a real worker: a repeated greedy request is answered
from the cache event for event, and the cache survives a restart of the coordinator (SQLite)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from protocol.health import Heartbeat, WorkerLoad
from tests.integration.conftest import TOKEN, Cluster, Proc, start_coordinator, start_worker
from tests.polling import wait_until

pytestmark = pytest.mark.model
BODY = {"prompt": "Name three rivers.", "max_tokens": 12, "temperature": 0}


def register(url: str, cluster: Cluster) -> None:
    health = httpx.get(cluster.worker_urls["w1"] + "/worker/health", timeout=5).json()
    beat = Heartbeat(worker_id="w1", url=cluster.worker_urls["w1"], model=health["model"],
                     load=WorkerLoad(**health["load"]), timestamp=time.time())
    assert httpx.post(url + "/coordinator/health/heartbeat", content=beat.model_dump_json(),
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=5).is_success


def events(response: httpx.Response) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    out = []
    for block in response.text.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        if block.startswith("event: "):
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_replayed_from_memory_and_after_a_restart(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    args = ("--worker-token", TOKEN, "--heartbeat-interval", "60", "--cache-entries", "100", "--cache-path", str(path))
    proc, url = start_coordinator(tmp_path, "cache-coordinator", *args)
    try:
        register(url, cluster)
        live = httpx.post(url + "/coordinator/infer", json=BODY, timeout=60)
        hit = httpx.post(url + "/coordinator/infer", json=BODY, timeout=60)
    finally:
        Proc.stop(proc)
    assert live.headers["x-worker-id"] == "w1" and hit.headers["x-worker-id"] == "cache"
    assert events(hit)[:-1] == events(live)[:-1] and len(events(live)) >= 2
    assert events(hit)[-1][1]["cached"] is True and events(hit)[-1][1]["usage"]["completion_tokens"] == 0
    proc, url = start_coordinator(tmp_path, "cache-coordinator-2", *args)
    try:
        register(url, cluster)
        after = httpx.post(url + "/coordinator/infer", json=BODY, timeout=60)
    finally:
        Proc.stop(proc)
    assert after.headers["x-worker-id"] == "cache" and events(after)[:-1] == events(live)[:-1]


def test_a_model_swapped_under_the_same_name_misses_the_cache(model_path: Path, gemma_path: Path,
                                                              tmp_path: Path) -> None:
    """Cached under SmolLM2, then Gemma 3 served under the same public name by a worker of the same id:
    the same request is computed by Gemma, not replayed (before: SmolLM2's answer, `cached: true`)."""
    proc, url = start_coordinator(tmp_path, "swap-coordinator", "--worker-token", TOKEN, "--heartbeat-interval",
                                  "1", "--cache-entries", "100")
    body = {**BODY, "model": "swapped"}

    def serve(path: Path) -> Proc:
        worker, _ = start_worker(tmp_path, "swap-worker", url, path, "--threads", "1", "--model-name", "swapped",
                                 "--heartbeat-interval", "0.5", "--worker-token", TOKEN)
        wait_until(lambda: httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 1, 60,
                   "the worker to be alive")
        return worker

    try:
        smollm = serve(model_path)
        live = httpx.post(url + "/coordinator/infer", json=body, timeout=60)
        hit = httpx.post(url + "/coordinator/infer", json=body, timeout=60)
        Proc.stop(smollm)
        wait_until(lambda: httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 0, 30,
                   "the coordinator to see the worker gone")
        gemma = serve(gemma_path)
        swapped = httpx.post(url + "/coordinator/infer", json=body, timeout=60)
        Proc.stop(gemma)
    finally:
        Proc.stop(proc)
    assert live.headers["x-worker-id"] == "swap-worker" and hit.headers["x-worker-id"] == "cache"
    assert swapped.status_code == 200 and swapped.headers["x-worker-id"] == "swap-worker"
    assert events(swapped)[-1][1]["cached"] is False and events(swapped)[-1][0] == "done"
