"""The circuit breaker with a real coordinator: a worker that accepts connections but answers 500
leaves scheduling (its requests fail over to a real worker), and comes back through one probe once
it recovers. The flaky worker is a small HTTP server in this test; the other is the cluster's w1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol.health import Heartbeat, WorkerLoad
from tests.conftest import free_port
from tests.integration.conftest import TOKEN, Cluster, Proc, start_coordinator
from tests.polling import wait_until

pytestmark = pytest.mark.model
DONE = ('{"finished":true,"finish_reason":"stop","usage":{"prompt_tokens":3,"cached_tokens":0,"completion_tokens":1,'
        '"total_tokens":4},"timings":{"queue_ms":0,"prefill_ms":1,"ttft_ms":1,"total_ms":1,"tokens_per_second":0},'
        '"request_id":"r","worker_id":"flaky","model":"%s"}')


class Flaky:
    """A worker that answers 500 until `healthy`, then streams one token and `done`."""

    def __init__(self, model: str) -> None:
        self.model, self.healthy, self.calls = model, False, 0
        self.port = free_port()
        app = Starlette(routes=[Route("/worker/generate", self.generate, methods=["POST"]),
                                Route("/worker/health", self.health)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def health(self, request: Request) -> Response:
        """Its health answers (the coordinator probes it before registering it); its generate fails."""
        return JSONResponse({"status": "ok", "worker_id": "a-flaky", "model": self.model})

    async def generate(self, request: Request) -> Response:
        self.calls += 1
        if not self.healthy:
            return JSONResponse({"error": "boom", "reason": "internal", "request_id": "r"}, status_code=500)
        body = 'event: admitted\r\ndata: {"prompt_tokens":3}\r\n\r\n' \
               'event: token\r\ndata: {"token":"hi","index":0,"probability":0.5,"finished":false}\r\n\r\n' \
               f"event: done\r\ndata: {DONE % self.model}\r\n\r\n"
        return StreamingResponse(iter([body.encode()]), media_type="text/event-stream")

    def __enter__(self) -> Self:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the flaky worker to listen")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def coordinator(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    """A coordinator of its own (heartbeats registered by hand, so nothing goes stale meanwhile)."""
    proc, url = start_coordinator(tmp_path, "breaker-coordinator", "--worker-token", TOKEN, "--heartbeat-interval", "60",
                                  "--breaker-failures", "2", "--breaker-cooldown", "1", "--queue-size", "0")
    try:
        yield url
    finally:
        Proc.stop(proc)


def register(url: str, worker_id: str, worker_url: str, model: str, load: WorkerLoad) -> None:
    beat = Heartbeat(worker_id=worker_id, url=worker_url, model=model, load=load, timestamp=time.time())
    assert httpx.post(url + "/coordinator/health/heartbeat", content=beat.model_dump_json(),
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=5).is_success


def breaker_of(url: str, worker_id: str) -> str:
    listing = httpx.get(url + "/coordinator/health/workers", timeout=5).json()["workers"]
    return str(next(w["breaker"] for w in listing if w["worker_id"] == worker_id))


def test_a_worker_answering_500_is_broken_out_and_probed_back(cluster: Cluster, coordinator: str) -> None:
    health = httpx.get(cluster.worker_urls["w1"] + "/worker/health", timeout=5).json()
    model, real = health["model"], WorkerLoad(**health["load"])
    with Flaky(model) as flaky:
        # The flaky worker looks idle and w1 a little busy, so the flaky one is always tried first.
        register(coordinator, "a-flaky", f"http://127.0.0.1:{flaky.port}", model, real)
        register(coordinator, "w1", cluster.worker_urls["w1"], model, real.model_copy(update={"sessions": 1}))
        body = {"prompt": "Say hi.", "max_tokens": 4}
        for _ in range(2):
            response = httpx.post(coordinator + "/coordinator/infer", json=body, timeout=60)
            assert response.status_code == 200 and response.headers["x-worker-id"] == "w1"  # failed over
        assert flaky.calls == 2 and breaker_of(coordinator, "a-flaky") == "open"
        response = httpx.post(coordinator + "/coordinator/infer", json=body, timeout=60)
        assert response.headers["x-worker-id"] == "w1" and flaky.calls == 2  # not even tried
        flaky.healthy = True
        time.sleep(1.1)  # the cool-down
        probe = httpx.post(coordinator + "/coordinator/infer", json=body, timeout=60)
        assert probe.status_code == 200 and probe.headers["x-worker-id"] == "a-flaky" and flaky.calls == 3
        assert breaker_of(coordinator, "a-flaky") == "closed"
