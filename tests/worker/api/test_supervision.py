"""Every background task of a worker is supervised: a fault is logged, counted, and the task goes on
(faults injected into the heartbeat loop and into one engine step)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import running_worker


def test_a_fault_in_the_heartbeat_loop_is_counted_and_the_heartbeats_go_on(tmp_path: Path) -> None:
    calls: list[float] = []

    def coordinator(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("a bug while sending the first heartbeat")
        return httpx.Response(200, json={"worker_id": "w", "state": "alive", "heartbeat_interval": 0.2})

    with running_worker(tmp_path / "none.gguf", engine="simulated", coordinator_url="http://coordinator.test",
                        heartbeat_interval=0.2, transport=httpx.MockTransport(coordinator)) as worker:
        wait_until(lambda: len(calls) >= 4, 10, "heartbeats to go on after the fault")
        assert worker.metric('worker_internal_errors_total{task="heartbeats"}') == 1


@pytest.mark.model
def test_a_fault_in_one_engine_step_ends_its_streams_with_an_error_and_the_engine_goes_on(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=2) as worker:
        engine: Any = worker.runtime.engine
        real_step = engine._step
        failures = [1]

        def flaky_step(touched: Any) -> Any:
            if failures:
                failures.pop()
                raise RuntimeError("injected engine fault")
            return real_step(touched)

        engine._step = flaky_step
        failed = generate(worker.url, {"prompt": "Hi", "max_tokens": 8})
        assert failed.status == 200 and failed.last[0] == "error" and failed.last[1]["reason"] == "engine_failed"
        served = generate(worker.url, {"prompt": "Hi", "max_tokens": 8})
        assert served.status == 200 and served.last[0] == "done"
        assert worker.metric('worker_internal_errors_total{task="engine_step"}') == 1
        wait_until(lambda: worker.load()["sessions"] == 0 and worker.load()["kv_reserved_bytes"] == 0, 5,
                   "the failed request's sequence freed")
