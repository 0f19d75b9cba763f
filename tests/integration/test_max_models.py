"""A real worker keeping two models of its folder loaded at once (`--max-models 2`, issue 37), to a real
coordinator: a request for the second model loads it beside the first, with no swap, while a stream of
the first goes on to its end; each model is a worker of its own to the coordinator (`<id>.m1` at
`<url>/slots/1`), its sessions kept and continued there; `/v1/models` lists both as loaded; the
worker's own health stays 200 at its URL, and a slot past its count is not found."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import alive_worker, folder_pool
from tests.polling import wait_until

pytestmark = pytest.mark.model
SMOL, GEMMA = "smollm2-135m-8k-lc100k-mix1-ep2", "gemma-3-270m"


@pytest.fixture(scope="module")
def pool(model_path: Path, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with folder_pool(tmp_path_factory.mktemp("max-models"), model_path, gemma_path, "two",
                     "--max-models", "2") as (url, _, port):
        yield url, f"http://127.0.0.1:{port}"


def events_of(url: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", url + "/coordinator/infer", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [line[7:] for line in response.iter_lines() if line.startswith("event: ")]


def swaps(worker_url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(worker_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("worker_model_swaps_total{"):
            found[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_second_model_loads_beside_the_first_without_cutting_its_stream(pool: tuple[str, str]) -> None:
    url, worker_url = pool
    first: list[list[str]] = []
    streaming = threading.Thread(target=lambda: first.append(events_of(url, {
        "prompt": "Count from one to fifty in words.", "max_tokens": 320, "ignore_eos": True, "model": SMOL,
        "temperature": 0})))
    streaming.start()
    wait_until(lambda: (alive_worker(url, "two") or {}).get("active_streams", 0) >= 1 or not streaming.is_alive(),
               20, "the first model's stream to run", interval=0.05)
    # The second model, asked for while the first streams: loaded into the second slot, answered whole.
    assert events_of(url, {"prompt": "Say hi.", "max_tokens": 8, "model": GEMMA, "temperature": 0,
                           "session_id": "kept"})[-1] == "done"
    overlapped = streaming.is_alive()  # most runs: the first stream outlives the load and the answer
    streaming.join(60)
    assert first and first[0][-1] == "done" and "error" not in first[0], first
    assert swaps(worker_url) == {"added": 1.0}  # one load, no swap: nothing drained, nothing unloaded
    print(f"the first model's stream outlived the second's load: {overlapped}")

    one, two = alive_worker(url, "two"), alive_worker(url, "two.m1")
    assert one is not None and two is not None
    assert (one["model"], one["url"], one["draining"]) == (SMOL, worker_url, False)
    assert (two["model"], two["url"], two["draining"]) == (GEMMA, worker_url + "/slots/1", False)
    models = {m["id"]: m.get("state") for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]}
    assert models == {SMOL: "loaded", GEMMA: "loaded"}, models

    # The kept session lives in the second slot, and its next turn continues there.
    wait_until(lambda: (alive_worker(url, "two.m1") or {}).get("sessions") == 1, 10, "the session listed")
    assert events_of(url, {"prompt": " And again.", "max_tokens": 8, "model": GEMMA, "session_id": "kept",
                           "temperature": 0})[-1] == "done"
    assert (alive_worker(url, "two") or {}).get("sessions") == 0
    # Ended through the coordinator, which finds it in slot 1 (and the worker's stop waits for no move).
    assert httpx.delete(url + "/coordinator/sessions/kept", timeout=5).status_code == 204
    wait_until(lambda: (alive_worker(url, "two.m1") or {}).get("sessions") == 0, 10, "the session ended")

    # Each slot answers for itself; the worker's own URL stays healthy, a slot past the count is not found.
    assert httpx.get(worker_url + "/slots/1/worker/health", timeout=5).json()["worker_id"] == "two.m1"
    assert httpx.get(worker_url + "/worker/health", timeout=5).json()["worker_id"] == "two"
    assert httpx.get(worker_url + "/slots/2/worker/health", timeout=5).status_code == 404
    # Asked again for a model it serves: loaded, from either slot's URL.
    for base in (worker_url, worker_url + "/slots/1"):
        answer = httpx.post(base + "/worker/models/load", json={"model": GEMMA}, timeout=5)
        assert (answer.status_code, answer.json()["state"]) == (200, "loaded")
