"""Slow and vanishing clients: cut off at the deadline, worker request cancelled, KV freed at once."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from protocol.health import Heartbeat, WorkerLoad
from tests.integration.conftest import TOKEN, Cluster, Proc, start_coordinator
from tests.integration.streams import Timed, infer
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
DEADLINE = 1.0


def metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture
def tight_coordinator(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A second coordinator with small buffers that knows only w1 (registered by hand), so two
    requests through it share one worker. Returns (coordinator URL, worker id)."""
    proc, url = start_coordinator(
        tmp_path, "tight-coordinator", "--worker-token", TOKEN, "--heartbeat-interval", "60", "--relay-buffer-events", "8",
        "--relay-write-deadline", str(DEADLINE), "--client-send-buffer-bytes", "4096")
    try:
        health = httpx.get(cluster.worker_urls["w1"] + "/worker/health", timeout=5).json()
        beat = Heartbeat(worker_id="w1", url=cluster.worker_urls["w1"], model=health["model"],
                         load=WorkerLoad(**health["load"]), timestamp=time.time())
        assert httpx.post(url + "/coordinator/health/heartbeat", content=beat.model_dump_json(), headers={"authorization": f"Bearer {TOKEN}"},
                          timeout=5).status_code == 200
        yield url, "w1"
    finally:
        Proc.stop(proc)


def open_slow_reader(url: str, body: dict) -> socket.socket:  # type: ignore[type-arg]
    """A client with a tiny receive buffer that reads the status line and then stops reading."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /coordinator/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(256)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


@pytest.mark.solo
async def test_slow_reader_is_cut_off_while_a_normal_reader_keeps_its_pace(
        cluster: Cluster, tight_coordinator: tuple[str, str]) -> None:
    url, worker_id = tight_coordinator
    slow = open_slow_reader(url, {"prompt": "Write a long essay.", "max_tokens": 450, "ignore_eos": True})
    stalled_at = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            reader = asyncio.create_task(
                infer(client, url, {"prompt": "Write a poem.", "max_tokens": 400, "ignore_eos": True}))
            cut_at = await until_cut(client, url, timeout=30)
            normal = await asyncio.wait_for(reader, timeout=60)
        # Whatever the buffers held is still readable; then the coordinator has closed the connection.
        slow.settimeout(5)
        rest = b""
        while chunk := slow.recv(65536):
            rest += chunk
    finally:
        slow.close()
    assert b"event: done" not in rest and b"event: token" in rest
    # Every token arrived: an event carries several when a character spans tokens, so count by index.
    assert normal.status == 200 and normal.names[-1] == "done" and normal.events[-1][1]["usage"]["completion_tokens"] == 400
    assert [data["index"] for name, data in normal.events if name == "token"][-1] == 399
    assert normal.headers["x-worker-id"] == worker_id
    times = normal.token_times
    # The slow client was cut while the normal one was still streaming from the same worker batch,
    # and the normal one never waited on its neighbour: no gap near the deadline.
    assert times[0] < cut_at < times[-1]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < DEADLINE / 2, max(gaps)
    assert len(times) / (times[-1] - times[0]) > 10
    print(f"cut after {cut_at - stalled_at:.2f} s; normal: {len(times)} tokens in {times[-1] - times[0]:.2f} s, "
          f"max gap {max(gaps) * 1000:.0f} ms, finished {times[-1] - stalled_at:.2f} s after the stall; "
          f"the slow reader's buffers still held {rest.count(b'event: token')} tokens")
    # The worker's request was cancelled with the client: its KV is free.
    wait_until(lambda: cluster.worker_load(worker_id)["sessions"] == 0
               and cluster.worker_load(worker_id)["kv_used_bytes"] == 0, 3, "the worker to free the KV")
    assert coordinator_health(url)["kv_reserved_bytes"] == 0


def coordinator_health(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(url + "/coordinator/health", timeout=5).json()


async def until_cut(client: httpx.AsyncClient, url: str, *, timeout: float) -> float:
    """Poll the coordinator's metric without blocking the normal reader; the time it moved."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (await client.get(url + "/metrics")).text
        if any(line.startswith("coordinator_slow_client_disconnects_total 1") for line in text.splitlines()):
            return time.monotonic()
        await asyncio.sleep(0.05)
    raise AssertionError("the slow client was not cut off")


async def test_client_that_disconnects_frees_the_worker_kv_at_once(cluster: Cluster) -> None:
    before = metric(cluster.url, "coordinator_client_disconnects_total")
    async with httpx.AsyncClient(timeout=30) as client:
        early = await infer(client, cluster.url, {"prompt": "Tell a long tale.", "max_tokens": 400,
                                                  "ignore_eos": True}, stop_after_tokens=5)
    hung_up = time.monotonic()
    assert isinstance(early, Timed) and early.names == ["token"] * 5
    worker_id = early.headers["x-worker-id"]
    wait_until(lambda: cluster.worker_load(worker_id)["kv_used_bytes"] == 0
               and cluster.worker_load(worker_id)["sessions"] == 0, 2, "the worker to free the KV", interval=0.02)
    assert time.monotonic() - hung_up < 2
    wait_until(lambda: cluster.coordinator_health()["requests_running"] == 0, 2, "the stream to be closed")
    assert cluster.coordinator_health()["kv_reserved_bytes"] == 0
    assert metric(cluster.url, "coordinator_client_disconnects_total") == before + 1
    await asyncio.sleep(0)
