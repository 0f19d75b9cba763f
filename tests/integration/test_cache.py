"""The response cache with a real coordinator and a real worker: a repeated greedy request is answered
from the cache event for event, and the cache survives a restart of the coordinator (SQLite)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from protocol.health import Heartbeat, WorkerLoad
from tests.integration.conftest import TOKEN, Cluster, Proc, start_coordinator

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
