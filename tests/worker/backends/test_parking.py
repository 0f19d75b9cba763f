"""Parking (preemption), on the real model: an interactive request that finds every sequence taken by
batch requests parks one (its cells to host memory), runs in its place, and the parked request resumes
where it stopped.

What must hold: the interactive request is served while both batch requests run; the parked request's
client sees a pause and never an error; its greedy output is byte for byte the output of the same run
unparked; nothing stays reserved or parked after; a parked request whose client leaves ends there.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sse import SseParser, generate
from tests.worker.server import RunningWorker, running_worker

pytestmark = pytest.mark.model

BATCH = [{"prompt": "Write a long letter to a friend about the sea.", "max_tokens": 96, "temperature": 0,
          "ignore_eos": True, "priority": "batch"},
         {"prompt": "List the rivers of Europe and describe each one.", "max_tokens": 96, "temperature": 0,
          "ignore_eos": True, "priority": "batch"}]
URGENT = {"prompt": "Say hello.", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=2, session_max_tokens=256) as running:
        yield running


class Stream(threading.Thread):
    """One streamed request read to its end in a thread: its events, and when its tokens came."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[tuple[str, str]] = []
        self.times: list[float] = []  # time.monotonic() of each token event
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        parser = SseParser()
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", self.url + "/worker/generate", json=self.body) as response:
            for chunk in response.iter_bytes():
                for event in parser.feed(chunk):
                    self.events.append((event.event, event.data))
                    if event.event == "token":
                        self.times.append(time.monotonic())
                        self.first.set()

    @property
    def text(self) -> str:
        return "".join(json.loads(data)["token"] for name, data in self.events if name == "token")

    @property
    def ending(self) -> str:
        return self.events[-1][0] if self.events else ""


def _both(url: str) -> list[Stream]:
    streams = []
    for body in BATCH:  # one after the other: the second is the latest started, the one parked
        streams.append(Stream(url, body))
        assert streams[-1].first.wait(timeout=60)
    return streams


def test_an_interactive_request_parks_a_batch_one_which_resumes_byte_identical(worker: RunningWorker) -> None:
    unparked = _both(worker.url)
    for stream in unparked:
        stream.join(timeout=120)
    parks = worker.metric("worker_preemptions_total")

    parked = _both(worker.url)
    urgent = generate(worker.url, URGENT)
    assert urgent.last[0] == "done" and urgent.text, urgent.events  # served while both batch requests were running
    assert worker.metric("worker_preemptions_total") == parks + 1
    _resumed(worker)  # as soon as the interactive request has ended
    for stream in parked:
        stream.join(timeout=120)
    assert [s.ending for s in parked] == ["done", "done"]  # a pause, never an error
    assert [s.text for s in parked] == [s.text for s in unparked]
    assert worker.metric("worker_preempted_seconds_count") >= 1
    _settled(worker)


def test_a_parked_request_whose_client_leaves_ends_and_holds_nothing(worker: RunningWorker) -> None:
    holders = _both(worker.url)
    closed = threading.Event()

    def leave_while_parked() -> None:
        # A batch stream opened and closed again while the interactive request below holds its place.
        with httpx.Client(timeout=60) as client, client.stream("POST", worker.url + "/worker/generate",
                                                               json={**BATCH[0], "max_tokens": 200}) as r:
            next(r.iter_lines())
        closed.set()

    leaving = threading.Thread(target=leave_while_parked, daemon=True)
    leaving.start()
    assert closed.wait(timeout=60)
    urgent = generate(worker.url, {**URGENT, "max_tokens": 4})
    assert urgent.last[0] == "done"
    for stream in holders:
        stream.join(timeout=120)
    _settled(worker)


def _resumed(worker: RunningWorker) -> None:
    deadline = time.monotonic() + 10
    while worker.runtime.table.parked and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.runtime.table.parked == 0, "the parked request never resumed"


def _settled(worker: RunningWorker) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = worker.load()
        if load["sessions"] == 0 and load["parked"] == 0 and load["kv_reserved_bytes"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"capacity still held: {worker.load()}")
