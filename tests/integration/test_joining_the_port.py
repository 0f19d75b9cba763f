"""Coordinators that share a port (REUSE_PORT, each with a port of its own) refuse nothing their
siblings could serve: a restarted one joins the port only once it knows the pool, and a draining one
leaves it at once while its streams finish (issue 33, item 2).

Before: one second after a kill and start.sh's restart, 18 of 20 requests got `503 no_workers`; during
a sibling's 28.5 s drain, 311 of 617 new requests got `503 draining`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator, start_worker
from tests.polling import wait_until

pytestmark = pytest.mark.model
INTERVAL = 2.0  # workers' and coordinators' heartbeat interval: a restarted coordinator hears from each within it


class Pool:
    def __init__(self, tmp_path: Path, model_path: Path) -> None:
        self.tmp_path = tmp_path
        self.shared = free_port()
        self.own = [free_port(), free_port()]
        self.coordinators: list[Proc | None] = [None, None]
        self.workers: list[Proc] = []
        self.url = f"http://127.0.0.1:{self.shared}"
        self.own_urls = [f"http://127.0.0.1:{port}" for port in self.own]
        self.starts = 0
        for i in range(2):
            self.start(i)
        for worker_id in ("w1", "w2"):
            worker, _ = start_worker(tmp_path, worker_id, ",".join(self.own_urls), model_path, "--threads", "1",
                                     "--max-sessions", "6", "--heartbeat-interval", str(INTERVAL))
            self.workers.append(worker)
        for i in range(2):
            self.wait_ready(i, 60)

    def start(self, i: int) -> None:
        self.starts += 1
        self.coordinators[i], _ = start_coordinator(
            self.tmp_path, f"c{i + 1}-{self.starts}", "--reuse-port", "true", "--own-port", str(self.own[i]),
            "--heartbeat-interval", str(INTERVAL), port=self.shared)

    def ready(self, i: int) -> dict:  # type: ignore[type-arg]
        response = httpx.get(self.own_urls[i] + "/coordinator/ready", timeout=2)
        return {"code": response.status_code, **response.json()}

    def wait_ready(self, i: int, timeout: float) -> None:
        wait_until(lambda: self.ready(i) == {"code": 200, "status": "ready", "workers": 2}, timeout,
                   f"c{i + 1} ready with both workers")

    def stop(self) -> None:
        for proc in [*reversed(self.workers), *self.coordinators]:
            if proc is not None:
                proc.stop()


@pytest.fixture
def pool(model_path: Path, tmp_path: Path) -> Iterator[Pool]:
    started = Pool(tmp_path, model_path)
    try:
        yield started
    finally:
        started.stop()


RESET = "RemoteProtocolError: Server disconnected without sending a response"


def once(url: str) -> int | str:
    """One short request on a connection of its own (the kernel picks a process per connection): its
    status (0: a 200 without its `done`), or the client's error."""
    try:
        with httpx.Client(timeout=30) as client:
            response = client.post(url + "/coordinator/infer", json={"prompt": "Say hi.", "max_tokens": 2})
            return response.status_code if b"event: done" in response.content or response.status_code != 200 else 0
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


def finished(own_url: str) -> float:
    text = httpx.get(own_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("coordinator_request_finished_total"))


def test_a_restarted_coordinator_takes_no_connection_before_it_knows_the_pool(pool: Pool) -> None:
    first = pool.coordinators[0]
    assert first is not None and first.popen is not None
    first.signal(signal.SIGKILL)
    first.popen.wait(timeout=10)
    pool.start(0)  # answers on its own port when this returns; the workers beat to it within INTERVAL
    # All at once, on 20 connections, before the workers' next beats reach it (a worker beats again soon
    # to a coordinator it has not reached): one after another, the few sent before it heard from them
    # could all land on the sibling, and a coordinator joining the port at once then went unnoticed.
    with ThreadPoolExecutor(20) as burst:
        codes = list(burst.map(once, [pool.url] * 20))
    assert codes == [200] * 20, codes
    pool.wait_ready(0, 3 * INTERVAL)
    before = finished(pool.own_urls[0])
    codes: list[int | str] = []
    while len(codes) < 48 and finished(pool.own_urls[0]) == before:  # joined: it takes its share now
        codes.append(once(pool.url))
    assert codes == [200] * len(codes), codes
    # The kernel spreads connections by a hash of each one's ports: 48 in a row to the sibling would
    # be a chance of 2^-48 with both listening (16 in a row did once, in a full run on a loaded machine:
    # its cause is not known, so the test now waits for the first one rather than counting 16).
    assert finished(pool.own_urls[0]) > before, f"none of {len(codes)} connections went to the restarted one"


def long_stream(url: str, outcome: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/coordinator/infer", timeout=60,
                      json={"prompt": "Count.", "max_tokens": 160, "ignore_eos": True}) as response:
        event = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
                started.set()
            elif line.startswith("data: ") and event in ("done", "error"):
                outcome.append(event)
                return
    outcome.append(f"no ending ({response.status_code})")


def test_a_draining_coordinator_leaves_the_port_and_a_rolling_restart_refuses_nothing(pool: Pool) -> None:
    codes: list[int | str] = []
    resets: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            code = once(pool.url)
            if isinstance(code, str) and code.startswith(RESET):
                # The documented limit (coordinator/server.py, docs/reliability.md): a connection the kernel
                # queued to the draining process in the instant before it closed its socket is reset before
                # any response; nothing ran there, and a client sends it again. Any other failure counts.
                resets.append(code)
                code = once(pool.url)
            codes.append(code)

    kept = httpx.Client(timeout=30)  # a client's pool of keep-alive connections
    try:
        kept.post(pool.url + "/coordinator/infer", json={"prompt": "Hi.", "max_tokens": 1})
        outcomes: list[list[str]] = [[], []]
        flags = [threading.Event(), threading.Event()]
        streams = [threading.Thread(target=long_stream, args=(pool.own_urls[0], outcomes[i], flags[i]))
                   for i in range(2)]
        for thread in streams:
            thread.start()
        assert all(flag.wait(30) for flag in flags)
        loader = threading.Thread(target=load)
        loader.start()
        for i in (0, 1):  # drain one, start it again, wait until it is ready; then the other
            proc = pool.coordinators[i]
            assert proc is not None and proc.popen is not None
            proc.signal(signal.SIGTERM)
            if i == 0:
                time.sleep(0.5)
                assert pool.ready(0)["status"] == "draining"
                # An idle keep-alive connection to it was closed: the next request goes to a sibling.
                # (Either way: the kernel picked one of the two processes for that connection.)
                response = kept.post(pool.url + "/coordinator/infer", json={"prompt": "Hi.", "max_tokens": 1})
                assert response.status_code == 200, response.text
            assert proc.popen.wait(timeout=60) == 0
            pool.start(i)
            pool.wait_ready(i, 3 * INTERVAL)
        stop.set()
        loader.join(timeout=60)
        for thread in streams:
            thread.join(timeout=60)
    finally:
        stop.set()
        kept.close()
    assert outcomes == [["done"], ["done"]]  # the drained process's streams finished on their connections
    refused = [code for code in codes if code != 200]
    assert len(codes) >= 20 and refused == [], (len(codes), refused)
    assert len(resets) <= 2, resets  # the instant of each of the two closes, at most
