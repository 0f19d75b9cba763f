"""Cut steps, on the real model: a decode step that carries batch requests' rows is cut short when an
interactive request comes, and the rows it carried go in again after it (worker/backends/llama_interrupt.py).

What must hold: the batch requests' greedy output byte for byte what it is with no interactive request
beside them (a cut loses no token and repeats none, its cells neither), a long prompt's prefill cut
included; every interactive request served; steps were cut; nothing held after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sse import generate
from tests.worker.backends.test_parking import BATCH as PARKED
from tests.worker.backends.test_parking import URGENT as PARKING_URGENT
from tests.worker.backends.test_parking import Stream
from tests.worker.server import RunningWorker, running_worker

pytestmark = pytest.mark.model

LONG = ("The lighthouse keeper wrote down every ship that passed the point, its name, its flag, the hour, "
        "the wind and the state of the sea, and in forty years he never missed a night. ") * 6
BATCH = [{"prompt": LONG + "Summarise his notes.", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
          "priority": "batch"}, PARKED[0]]
URGENT = {**PARKING_URGENT, "max_tokens": 2}


def busy(worker: RunningWorker) -> dict[str, float]:
    """worker_decode_busy_seconds_total by the rows its steps carried (each series there from the start)."""
    return {rows: worker.metric(f'worker_decode_busy_seconds_total{{rows="{rows}"}}')
            for rows in ("interactive", "batch", "both", "cut")}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512) as running:
        yield running


def test_interactive_requests_cut_batch_steps_and_the_batch_output_is_unchanged(
        worker: RunningWorker, caplog: pytest.LogCaptureFixture) -> None:
    reference = [Stream(worker.url, body) for body in BATCH]
    for stream in reference:
        stream.join(timeout=120)
    assert [s.ending for s in reference] == ["done", "done"]
    cuts, spent = worker.metric("worker_steps_cut_total"), busy(worker)

    streams = [Stream(worker.url, body) for body in BATCH]  # the long prompt's prefill starts at once
    served = []
    deadline = time.monotonic() + 120
    while any(s.is_alive() for s in streams) and time.monotonic() < deadline and len(served) < 40:
        served.append(generate(worker.url, URGENT).last[0])
    for stream in streams:
        stream.join(timeout=120)
    assert served and set(served) == {"done"}
    assert [s.ending for s in streams] == ["done", "done"]
    assert [s.text for s in streams] == [s.text for s in reference]
    assert worker.metric("worker_steps_cut_total") > cuts
    # The engine's time by what its steps carried: some thrown away by cuts, some the users' alone.
    now = busy(worker)
    assert now["cut"] > spent["cut"] and now["interactive"] > spent["interactive"]
    assert now["batch"] + now["both"] > spent["batch"] + spent["both"]
    # What llama.cpp says of an aborted decode is not the worker's warning: a cut is on purpose.
    assert not [r.message for r in caplog.records if r.name == "worker.llama"]
    load = worker.load()
    assert (load["sessions"], load["kv_reserved_bytes"]) == (0, 0)


def test_with_cuts_off_no_step_is_cut(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512, cut_batch_steps=False) as off:
        streams = [Stream(off.url, body) for body in BATCH]
        served = [generate(off.url, URGENT).last[0] for _ in range(4)]
        for stream in streams:
            stream.join(timeout=120)
        assert set(served) == {"done"} and [s.ending for s in streams] == ["done", "done"]
        assert off.metric("worker_steps_cut_total") == 0
        assert busy(off)["cut"] == 0 and busy(off)["batch"] > 0


def test_at_slowdown_one_batch_rows_sit_out_while_an_interactive_stream_decodes(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512, batch_slowdown=1.0) as worker:
        batch = [Stream(worker.url, {**body, "max_tokens": 200}) for body in BATCH]
        for stream in batch:
            assert stream.first.wait(timeout=60)
        urgent = Stream(worker.url, {**URGENT, "max_tokens": 40, "ignore_eos": True})
        urgent.join(timeout=60)
        for stream in batch:
            stream.join(timeout=120)
        assert urgent.ending == "done" and [s.ending for s in batch] == ["done", "done"]
        start, end = urgent.times[0], urgent.times[-1]
        beside = [sum(start < t < end for t in s.times) for s in batch]
        # A step or two while the share measures both kinds of step, then none (40 without the share).
        assert max(beside) <= 6, beside
        assert [len(s.times) for s in batch] == [200, 200]  # and then they went on to their end
