"""Two models behind one coordinator: a SmolLM2 worker (also answering to `tinyllama-1.1b`, the name
the original system's curl example uses) and a Gemma 3 worker. Routing, listing, capacity and loss
are per model. This pool is its own, so killing its Gemma worker disturbs no other test."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator, stop_all
from tests.integration.streams import Timed, infer, read_events
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
SMOL, GEMMA = "smollm2-135m-8k-lc100k-mix1-ep2", "gemma-3-270m"
LIMITS = ["--max-sessions", "2", "--session-max-tokens", "512", "--threads", "1", "--heartbeat-interval", "0.5"]


class Pool:
    def __init__(self, log_dir: Path, model_path: Path, gemma_path: Path) -> None:
        self.log_dir = log_dir
        self.coordinator, self.url = start_coordinator(log_dir, "coordinator-2m", "--heartbeat-interval", "1",
                                                       "--retry-after", "1", "--queue-size", "0")
        self.workers: dict[str, Proc] = {}
        self.start("smol", model_path, "--model-aliases", "tinyllama-1.1b")
        self.start("gem", gemma_path)
        for worker_id in self.workers:
            wait_until(lambda w=worker_id: self.state(w) == "alive", 60, f"{worker_id} alive", interval=0.2)

    def start(self, worker_id: str, model: Path, *extra: str) -> None:
        port = free_port()
        proc = Proc(worker_id, [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", worker_id,
                                "--coordinator-url", self.url, "--model-path", str(model), *LIMITS, *extra],
                    self.log_dir / f"{worker_id}.log")
        proc.start()
        self.workers[worker_id] = proc

    def listing(self, worker_id: str) -> dict[str, Any] | None:
        listing = httpx.get(self.url + "/coordinator/health/workers", timeout=2).json()["workers"]
        return next((w for w in listing if w["worker_id"] == worker_id), None)

    def state(self, worker_id: str) -> str | None:
        found = self.listing(worker_id)
        return None if found is None else found["state"]

    def stop(self) -> None:
        stop_all([*self.workers.values(), self.coordinator])


@pytest.fixture(scope="module")
def pool(model_path: Path, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    running = Pool(tmp_path_factory.mktemp("two-models"), model_path, gemma_path)
    try:
        yield running
    finally:
        running.stop()


async def chat(client: httpx.AsyncClient, url: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12, **extra}
    return await client.post(url + "/v1/chat/completions", json=body)


async def test_each_model_is_listed_and_served_by_its_own_worker(pool: Pool) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        listed = (await client.get(pool.url + "/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed) == [GEMMA, SMOL]
        for model, worker in ((GEMMA, "gem"), (SMOL, "smol"), ("tinyllama-1.1b", "smol"), (GEMMA, "gem")):
            response = await chat(client, pool.url, model)
            assert response.status_code == 200, response.text
            assert response.headers["x-worker-id"] == worker
            assert response.json()["model"] == (GEMMA if worker == "gem" else SMOL)
            # Gemma 3 270M is a base model without a chat template: plain turns, ended at the next one.
            # (The stop is a new line that opens a turn: a sampled "other user:" inside a line is text.)
            assert "\nuser:" not in response.json()["choices"][0]["message"]["content"]
        missing = await chat(client, pool.url, "llama-70b")
        assert missing.status_code == 404 and GEMMA in missing.json()["error"]["message"]
        unnamed = await client.post(pool.url + "/v1/completions", json={"prompt": "Hi"})
        assert unnamed.status_code == 400 and "model" in unnamed.json()["error"]["message"]


def test_the_original_curl_example_works_under_the_name_tinyllama(pool: Pool) -> None:
    curl = shutil.which("curl")
    assert curl is not None, "curl is part of the test machine"
    out = subprocess.run(
        [curl, "-sN", "--max-time", "120", "-X", "POST", pool.url + "/coordinator/infer", "-H",
         "Content-Type: application/json", "-d",
         json.dumps({"prompt": "What is the capital of France?", "model": "tinyllama-1.1b", "max_tokens": 1000})],
        capture_output=True, text=True, timeout=150, check=True).stdout
    blocks = [b for b in out.replace("\r\n", "\n").split("\n\n") if b.strip() and not b.startswith(":")]
    assert blocks[-1].startswith("event: done"), out[-500:]
    done = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert done["worker_id"] == "smol" and done["model"] == SMOL


async def hold(client: httpx.AsyncClient, url: str, model: str, release: asyncio.Event, opened: asyncio.Queue,  # type: ignore[type-arg]
               ) -> None:
    """Keeps reading a long stream (a stream that stops being read may finish into buffers)."""
    # raw: no chat turns, so no turn-stop string either (Gemma 3 270M has no template; its plain turns
    # stop at the next "user:", which a sampled reply sometimes writes at once and ends the hold).
    body = {"prompt": "Count.", "model": model, "max_tokens": 480, "ignore_eos": True, "raw": True}
    async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
        assert response.status_code == 200, (response.status_code, await response.aread())
        timed = Timed(response.status_code, dict(response.headers))
        reading = asyncio.create_task(read_events(response, timed))
        while "token" not in timed.names:
            assert not reading.done(), timed.events
            await asyncio.sleep(0.01)
        await opened.put(model)
        await release.wait()
        reading.cancel()


async def test_capacity_is_counted_per_model(pool: Pool) -> None:
    # Start from a gem worker the coordinator sees idle: no stream, no session, breaker closed.
    def idle() -> bool:
        gem = pool.listing("gem")
        return gem is not None and gem["sessions"] == 0 and gem["in_flight"] == 0 and gem["breaker"] == "closed"

    wait_until(idle, 15, "gem idle in the coordinator's view", interval=0.2)
    release, opened = asyncio.Event(), asyncio.Queue()  # type: ignore[var-annotated]
    async with httpx.AsyncClient(timeout=60) as client:
        holders = [asyncio.create_task(hold(client, pool.url, GEMMA, release, opened)) for _ in range(2)]
        try:
            both_open = asyncio.ensure_future(asyncio.gather(opened.get(), opened.get()))
            await asyncio.wait([both_open, *holders], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            failed = [h for h in holders if h.done()]
            if not both_open.done():
                both_open.cancel()
                detail = repr(failed[0].exception()) if failed else "no first token in 60 s"
                pytest.fail(f"a holding stream did not start: {detail}\n{pool.workers['gem'].log_tail()}")
            full = await infer(client, pool.url, {"prompt": "Hi", "model": GEMMA, "max_tokens": 2})
            assert full.status == 503 and full.body is not None and full.body["reason"] == "sessions_full"
            other = await infer(client, pool.url, {"prompt": "Hi", "model": SMOL, "max_tokens": 2})
            assert other.status == 200 and other.names[-1] == "done"
        finally:
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)


async def test_losing_the_last_worker_of_a_model_leaves_the_other_serving(pool: Pool) -> None:
    pool.workers["gem"].stop()
    wait_until(lambda: pool.state("gem") != "alive", 15, "the coordinator to see gem gone", interval=0.2)
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(2):  # while its record is stale, and after it is removed
            gone = await infer(client, pool.url, {"prompt": "Hi", "model": GEMMA, "max_tokens": 2})
            assert gone.status == 503 and gone.body is not None and gone.body["reason"] == "model_unavailable"
            assert (await chat(client, pool.url, SMOL)).status_code == 200
            wait_until(lambda: pool.state("gem") is None, 15, "gem removed", interval=0.2)
