"""Workers dying, hanging or lying: failover, error events, stale detection, heartbeat auth."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from protocol.health import Heartbeat, WorkerLoad
from tests.integration.conftest import COORDINATOR_HEARTBEAT, Cluster
from tests.integration.streams import Timed, infer, read_events
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
LONG = {"prompt": "Count slowly.", "max_tokens": 400, "ignore_eos": True}


def metric(cluster: Cluster, prefix: str) -> float:
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def first_choice(cluster: Cluster) -> str:
    """The worker the scheduler ranks first now: lowest score, then the one picked least recently
    (never picked first), then lowest id."""
    states = cluster.states()
    age = {w: states[w]["picked_age_s"] for w in states}
    return min(states, key=lambda w: (states[w]["score"], age[w] is not None, -(age[w] or 0.0), w))


async def test_worker_killed_before_the_first_token_is_failed_over(cluster: Cluster) -> None:
    victim = first_choice(cluster)
    survivor = next(w for w in cluster.workers if w != victim)
    before = metric(cluster, "coordinator_failovers_total")
    cluster.workers[victim].signal(signal.SIGKILL)
    cluster.workers[victim].popen.wait(timeout=5)  # type: ignore[union-attr]
    # Its last heartbeat is under 3 intervals old, so the coordinator still ranks it first.
    assert cluster.states()[victim]["state"] == "alive"
    async with httpx.AsyncClient(timeout=30) as client:
        result = await infer(client, cluster.url, {"prompt": "Hello", "max_tokens": 4})
    assert result.status == 200 and result.headers["x-worker-id"] == survivor
    assert result.names[-1] == "done"
    assert metric(cluster, "coordinator_failovers_total") == before + 1
    # Its port refused the connection: out of the pool now, not when its heartbeats are missed.
    assert cluster.states()[victim]["state"] == "stale"
    assert cluster.coordinator_health()["workers"]["alive"] == 1


async def test_a_worker_that_stops_leaves_the_pool_with_its_last_beat(cluster: Cluster) -> None:
    """Issue 33: a worker that exited stayed `alive` for 7 s (its missed beats); its sessions' next
    turns and new requests went to its closed port meanwhile."""
    leaving = "w2"
    assert cluster.states()[leaving]["state"] == "alive"
    cluster.workers[leaving].signal(signal.SIGTERM)
    cluster.workers[leaving].popen.wait(timeout=30)  # type: ignore[union-attr]
    assert cluster.states()[leaving]["state"] == "stale"  # its last beat was under 3 intervals ago
    assert cluster.coordinator_health()["workers"]["alive"] == 1


async def test_worker_killed_mid_stream_ends_a_stream_it_cannot_continue_with_an_error_event(
        cluster: Cluster) -> None:
    """A kept session's later turn is not continued on another worker (its history died with its worker):
    it ends with the error event at once, and the next turn is refused. (tests/integration/test_continuation.py
    has the streams that go on, a session's first turn among them.)"""
    async with httpx.AsyncClient(timeout=30) as client:
        first = await client.post(cluster.url + "/coordinator/infer",
                                  json={"prompt": "Hi.", "max_tokens": 2, "session_id": "killed-1"})
        assert first.status_code == 200 and "event: done" in first.text
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream("POST", cluster.url + "/coordinator/infer", json={**LONG, "session_id": "killed-1"}
                          ) as response:
        assert response.status_code == 200
        worker_id = response.headers["x-worker-id"]
        timed = Timed(200, dict(response.headers))
        lines = response.aiter_lines()
        reader = asyncio.create_task(read_events_from(lines, timed))
        await wait_for_tokens(timed, 5)
        killed_at = time.monotonic()
        cluster.workers[worker_id].signal(signal.SIGKILL)
        await asyncio.wait_for(reader, timeout=5)
    name, data = timed.events[-1]
    assert name == "error" and data["reason"] == "worker_failed" and data["finished"] is True
    assert "kept session's later turn is not continued" in data["error"]
    assert timed.times[-1] - killed_at < 1.0
    assert 5 <= timed.names.count("token") < 400
    wait_until(lambda: cluster.coordinator_health()["kv_reserved_bytes"] == 0, 2, "reservation released")
    assert cluster.coordinator_health()["requests_running"] == 0


async def read_events_from(lines, into: Timed) -> None:  # type: ignore[no-untyped-def]
    class Lines:  # adapts an existing line iterator to read_events
        def aiter_lines(self):  # type: ignore[no-untyped-def]
            return lines

    await read_events(Lines(), into)  # type: ignore[arg-type]


async def wait_for_tokens(timed: Timed, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while timed.names.count("token") < n:
        assert time.monotonic() < deadline, f"fewer than {n} tokens in {timeout} s"
        await asyncio.sleep(0.01)


def test_worker_that_stops_heartbeating_is_not_scheduled(cluster: Cluster) -> None:
    frozen = "w2"
    cluster.workers[frozen].signal(signal.SIGSTOP)  # alive as a process, silent as a worker
    try:
        started = time.monotonic()
        wait_until(lambda: cluster.states()[frozen]["state"] == "stale", 3 * COORDINATOR_HEARTBEAT + 2,
                   "the silent worker to go stale")
        assert time.monotonic() - started >= 3 * COORDINATOR_HEARTBEAT - 0.6  # 3 intervals, less one beat
        for _ in range(3):
            response = httpx.post(cluster.url + "/coordinator/infer", json={"prompt": "Hi", "max_tokens": 2},
                                  timeout=10)
            assert response.status_code == 200 and response.headers["x-worker-id"] == "w1"
        assert cluster.coordinator_health()["workers"] == {"alive": 1, "stale": 1, "total": 2}
    finally:
        cluster.workers[frozen].signal(signal.SIGCONT)
    wait_until(lambda: cluster.states()[frozen]["state"] == "alive", 5, "the worker to come back")


def test_heartbeats_without_the_token_are_refused(cluster: Cluster) -> None:
    load = WorkerLoad(sessions=0, max_sessions=4, active_streams=0, queue_depth=0, kv_used_bytes=0,
                      kv_reserved_bytes=0, kv_capacity_bytes=1 << 30, bytes_per_token=1, session_max_tokens=512)
    beat = Heartbeat(worker_id="intruder", url="http://127.0.0.1:9", model="SmolLM2-135M-Instruct.Q4_1",
                     load=load, timestamp=time.time())
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "integration-secret"}):
        response = httpx.post(cluster.url + "/coordinator/health/heartbeat", content=beat.model_dump_json(),
                              headers=headers, timeout=5)
        assert response.status_code == 401 and response.json()["reason"] == "unauthorized"
    assert "intruder" not in cluster.states()
    future = beat.model_copy(update={"timestamp": time.time() + 3600})
    response = httpx.post(cluster.url + "/coordinator/health/heartbeat", content=future.model_dump_json(),
                          headers={"authorization": "Bearer integration-secret"}, timeout=5)
    assert response.status_code == 400 and "intruder" not in cluster.states()


def test_workers_that_heartbeat_but_never_answer_are_not_registered(cluster: Cluster) -> None:
    """Three fakes with the worker token whose URL accepts connections and never answers: each
    heartbeat waits out the coordinator's probe and is refused, and no client request goes to them
    (before: they were ranked with the real workers, idle fakes won score ties, and 6 of 60 client
    requests got 502)."""
    load = WorkerLoad(sessions=0, max_sessions=4, active_streams=0, queue_depth=0, kv_used_bytes=0,
                      kv_reserved_bytes=0, kv_capacity_bytes=1 << 30, bytes_per_token=1, session_max_tokens=512)
    with socket.create_server(("127.0.0.1", 0), backlog=16) as mute:  # listens, never accepts nor answers
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"

        def beat(worker_id: str) -> httpx.Response:
            fake = Heartbeat(worker_id=worker_id, url=url, model=cluster.states()["w1"]["model"], load=load,
                             timestamp=time.time())
            return httpx.post(cluster.url + "/coordinator/health/heartbeat", content=fake.model_dump_json(),
                              headers={"authorization": "Bearer integration-secret"}, timeout=30)

        with ThreadPoolExecutor(3) as pool:
            refused = list(pool.map(beat, ["a-mute", "b-mute", "c-mute"]))
        assert all(r.status_code == 502 and r.json()["reason"] == "worker_unavailable" for r in refused)
        assert not {"a-mute", "b-mute", "c-mute"} & set(cluster.states())
        for _ in range(12):
            response = httpx.post(cluster.url + "/coordinator/infer", json={"prompt": "Hi.", "max_tokens": 2},
                                  timeout=30)
            assert response.status_code == 200 and response.headers["x-worker-id"] in {"w1", "w2"}
