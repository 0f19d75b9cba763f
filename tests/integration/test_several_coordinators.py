"""One worker, two real coordinators: it heartbeats to both (COORDINATOR_URL lists them), so each
holds it in its registry and serves through it; one coordinator killed does not keep the worker from
the other. And two coordinator processes on one port (REUSE_PORT, each with a port of its own for
heartbeats and metrics): the kernel spreads connections over both, and one killed leaves the port
served by the other."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = pytest.mark.model
INTERVAL = 0.5  # the coordinators': a worker is stale after 3 intervals without a beat


def state(url: str, worker_id: str) -> str | None:
    listing = httpx.get(url + "/coordinator/health/workers", timeout=2).json()["workers"]
    return next((w["state"] for w in listing if w["worker_id"] == worker_id), None)


def served_by(url: str) -> str:
    with httpx.stream("POST", url + "/coordinator/infer", timeout=60,
                      json={"prompt": "Say hello.", "max_tokens": 4, "temperature": 0}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    done = json.loads(lines[-1][6:])
    assert done.get("finished"), done
    return str(done["worker_id"])


@pytest.fixture
def pool(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[Proc, str, Proc, str]]:
    procs: list[Proc] = []
    try:
        c1, url1 = start_coordinator(tmp_path, "c1", "--heartbeat-interval", str(INTERVAL))
        procs.append(c1)
        c2, url2 = start_coordinator(tmp_path, "c2", "--heartbeat-interval", str(INTERVAL))
        procs.append(c2)
        worker, _ = start_worker(tmp_path, "w1", f"{url1},{url2}", tiny_model_path, "--threads", "1",
                                 "--max-sessions", "2", "--heartbeat-interval", str(INTERVAL / 2))
        procs.append(worker)
        yield c1, url1, c2, url2
    finally:
        stop_all(reversed(procs))


def test_a_worker_heartbeats_to_every_coordinator_and_outlives_one(pool: tuple[Proc, str, Proc, str]) -> None:
    c1, url1, _, url2 = pool
    for url in (url1, url2):
        wait_until(lambda url=url: state(url, "w1") == "alive", 60, f"w1 alive at {url}")
    assert served_by(url1) == "w1" and served_by(url2) == "w1"
    c1.signal(signal.SIGKILL)
    time.sleep(4 * INTERVAL)  # longer than the other coordinator waits before calling a worker stale
    assert state(url2, "w1") == "alive"
    assert served_by(url2) == "w1"


def finished(own_url: str) -> float:
    text = httpx.get(own_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("coordinator_request_finished_total"))


def test_two_coordinator_processes_share_one_port_and_outlive_each_other(tiny_model_path: Path, tmp_path: Path) -> None:
    shared, own = free_port(), [free_port(), free_port()]
    procs: list[Proc] = []
    try:
        for i, port in enumerate(own, start=1):
            proc, _ = start_coordinator(tmp_path, f"c{i}", "--reuse-port", "true", "--own-port", str(port),
                                        "--heartbeat-interval", str(INTERVAL), port=shared)
            procs.append(proc)
        own_urls = [f"http://127.0.0.1:{port}" for port in own]
        worker, _ = start_worker(tmp_path, "w1", ",".join(own_urls), tiny_model_path, "--threads", "1",
                                 "--max-sessions", "2", "--heartbeat-interval", str(INTERVAL / 2))
        procs.append(worker)
        for url in own_urls:
            wait_until(lambda url=url: state(url, "w1") == "alive", 60, f"w1 alive at {url}")
            # Each listens on the shared port only once it knows the pool (coordinator/pool/readiness.py):
            # a fast model's 16 requests could otherwise all be over before the second one joins.
            wait_until(lambda url=url: httpx.get(url + "/coordinator/ready", timeout=2).status_code == 200, 30,
                       f"{url} ready")
        url = f"http://127.0.0.1:{shared}"
        # Each request on a connection of its own: the kernel picks a process per connection.
        assert [served_by(url) for _ in range(16)] == ["w1"] * 16
        counts = [finished(u) for u in own_urls]
        assert sum(counts) == 16 and min(counts) >= 1, counts  # both processes served
        procs[0].signal(signal.SIGKILL)
        assert procs[0].popen is not None and procs[0].popen.wait(timeout=10) == -signal.SIGKILL
        assert [served_by(url) for _ in range(8)] == ["w1"] * 8  # the port is the survivor's alone now
        assert finished(own_urls[1]) == counts[1] + 8
    finally:
        stop_all(reversed(procs))


def turn(url: str, session_id: str, prompt: str) -> tuple[str, dict[str, int]]:
    with httpx.stream("POST", url + "/coordinator/infer", timeout=60,
                      json={"prompt": prompt, "session_id": session_id, "max_tokens": 4, "temperature": 0}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    done = json.loads(lines[-1][6:])
    assert done.get("finished"), done
    return str(done["worker_id"]), done["usage"]


def test_a_sessions_turns_alternating_between_coordinators_stay_on_its_worker(model_path: Path,
                                                                               tmp_path: Path) -> None:
    """Workers beat at the default 10 s: what tells the other coordinator where a new session went is
    the beat a worker sends as soon as it admits one. The default model: on the tiny one a turn ends
    in a few milliseconds, and the next, sent at once to the other coordinator, can arrive before that
    beat (50 ms after the admission) and go to another worker, a race this test does not cover."""
    procs: list[Proc] = []
    try:
        urls = []
        for name in ("c1", "c2"):
            proc, url = start_coordinator(tmp_path, name)
            procs.append(proc)
            urls.append(url)
        for worker_id in ("w1", "w2"):
            worker, _ = start_worker(tmp_path, worker_id, ",".join(urls), model_path, "--threads", "1",
                                     "--max-sessions", "4")
            procs.append(worker)
        for url in urls:
            for worker_id in ("w1", "w2"):
                wait_until(lambda url=url, w=worker_id: state(url, w) == "alive", 60, f"{worker_id} at {url}")
        # A first session on one worker, so that the second goes to the other one: a coordinator that
        # did not know where the second went would see two idle workers and take the first again.
        anchor, _ = turn(urls[0], "anchor", "Say a word.")
        served = []
        for i in range(20):
            worker_id, usage = turn(urls[i % 2], "alternating", f"Turn {i}: say a number.")
            served.append(worker_id)
            if i:
                assert usage["cached_tokens"] > 0, (i, usage)  # its history was there
        assert len(set(served)) == 1 and served[0] != anchor, (anchor, served)
    finally:
        stop_all(reversed(procs))


def stream(url: str, max_tokens: int, started: threading.Event | None = None) -> tuple[str, int]:
    """('done', tokens) or ('cut', tokens received) when the connection broke mid-stream."""
    tokens = 0
    try:
        with httpx.stream("POST", url + "/coordinator/infer", timeout=httpx.Timeout(60, connect=5),
                          json={"prompt": "Count to a hundred.", "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0}) as response:
            if response.status_code != 200:
                return f"status {response.status_code}", 0
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "token":
                    tokens += 1
                    if tokens == 2 and started is not None:
                        started.set()
                elif line.startswith("data: ") and event in ("done", "error"):
                    return event, tokens
    except httpx.HTTPError:
        return "cut", tokens
    return "ended without done", tokens


# Half through each coordinator; long enough that every stream still runs when the first coordinator dies.
STREAMS, STREAM_TOKENS = 16, 64


def test_a_coordinator_killed_under_load_loses_only_its_own_streams(model_path: Path, tmp_path: Path) -> None:
    # The default model: the streams must still be running when the coordinator is killed.
    procs: list[Proc] = []
    try:
        coordinators: list[tuple[Proc, str]] = []
        for name in ("c1", "c2"):
            coordinators.append(start_coordinator(tmp_path, name, "--heartbeat-interval", str(INTERVAL),
                                                  "--worker-read-timeout", "5"))
            procs.append(coordinators[-1][0])
        urls = [url for _, url in coordinators]
        worker_urls = []
        for worker_id in ("w1", "w2"):
            worker, worker_url = start_worker(tmp_path, worker_id, ",".join(urls), model_path, "--threads", "1",
                                              "--max-sessions", "16", "--heartbeat-interval", str(INTERVAL / 2))
            procs.append(worker)
            worker_urls.append(worker_url)
        for url in urls:
            for worker_id in ("w1", "w2"):
                wait_until(lambda url=url, w=worker_id: state(url, w) == "alive", 60, f"{worker_id} at {url}")
        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            flags = [threading.Event() for _ in range(STREAMS)]
            futures = [pool.submit(stream, urls[i % 2], STREAM_TOKENS, flags[i]) for i in range(STREAMS)]
            for flag in flags:
                assert flag.wait(60), "every stream generating"
            coordinators[0][0].signal(signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
            after = [f.result(timeout=120) for f in [pool.submit(stream, urls[1], 8) for _ in range(8)]]
        killed, survived = results[0::2], results[1::2]
        assert all(outcome == "cut" and 2 <= tokens < STREAM_TOKENS for outcome, tokens in killed), killed
        assert survived == [("done", STREAM_TOKENS)] * (STREAMS // 2), survived
        assert after == [("done", 8)] * 8, after
        # The workers freed what the dead coordinator's streams held: nothing is left running.
        for worker_url in worker_urls:
            wait_until(lambda u=worker_url: httpx.get(u + "/worker/health", timeout=2).json()["load"]["sessions"] == 0,
                       15, f"{worker_url} to free every sequence")
    finally:
        stop_all(reversed(procs))


SYSTEM = ("You are the archivist of a small mountain library. You answer questions about its catalogue, "
          "its opening hours and its rules, briefly and politely, and you never invent a book. ") * 8


def ask(url: str, question: str) -> tuple[str, int]:
    """(the worker that served it, its cached prompt tokens)."""
    with httpx.stream("POST", url + "/coordinator/infer", timeout=60,
                      json={"prompt": SYSTEM + question, "max_tokens": 2, "temperature": 0}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    done = json.loads(lines[-1][6:])
    assert done.get("finished"), done
    return str(done["worker_id"]), int(done["usage"]["cached_tokens"])


def worker_load(worker_url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(worker_url + "/worker/health", timeout=2).json()["load"]  # type: ignore[no-any-return]


def test_a_prefix_one_coordinator_sent_is_known_to_the_other_from_the_workers_heartbeats(
        tiny_model_path: Path, tmp_path: Path) -> None:
    """c1 sends a long system prompt to a worker; the worker's heartbeats list its blocks, so c2 sends
    the next prompt with that system prompt to the same worker, though by load alone it would pick
    the other (a kept session makes the holder busier)."""
    procs: list[Proc] = []
    flags = ("--heartbeat-interval", str(INTERVAL), "--scorers", "session_load:0.3,kv_load:0.2,prefix:0.5",
             "--prefix-balance-threshold", "0.9")
    try:
        urls = []
        for name in ("c1", "c2"):
            proc, url = start_coordinator(tmp_path, name, *flags)
            procs.append(proc)
            urls.append(url)
        worker_urls = {}
        for worker_id in ("w1", "w2"):
            worker, worker_urls[worker_id] = start_worker(tmp_path, worker_id, ",".join(urls), tiny_model_path,
                                                          "--threads", "1", "--max-sessions", "4",
                                                          "--heartbeat-interval", str(INTERVAL / 2))
            procs.append(worker)
        for url in urls:
            for worker_id in ("w1", "w2"):
                wait_until(lambda url=url, w=worker_id: state(url, w) == "alive", 60, f"{worker_id} at {url}")
        holder, _ = ask(urls[0], "When do you open?")
        other = next(w for w in worker_urls if w != holder)
        # A kept session straight on the holder: by load, both coordinators now prefer the other worker.
        # Raw text: no chat template shared with the system prompt's cells, so it takes other cells.
        with httpx.stream("POST", worker_urls[holder] + "/worker/generate", timeout=60,
                          json={"prompt": "Hello.", "raw": True, "session_id": "weight", "max_tokens": 1}) as response:
            assert response.status_code == 200, response.read()
            response.read()
        assert worker_load(worker_urls[other])["prefixes"] == []
        wait_until(lambda: (load := worker_load(worker_urls[holder]))["sessions"] == 1 and len(load["prefixes"]) >= 5,
                   10, "the holder to list the system prompt's blocks and its kept session")
        time.sleep(3 * INTERVAL)  # several of its heartbeats have reached both coordinators
        served = [ask(urls[1], f"Question {i}: may I borrow a map?") for i in range(3)]
        assert [w for w, _ in served] == [holder] * 3, (holder, served)
        assert all(cached >= 200 for _, cached in served), served  # the system prompt was reused
    finally:
        stop_all(reversed(procs))
