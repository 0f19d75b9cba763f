"""A real worker offering a folder with a keep-alive (`--keep-alive`, issue 37), to a real coordinator:
its model, idle past the keep-alive, is unloaded (the worker's memory falls by at least half the model's
file, its heartbeats say `standby`, `/v1/models` lists the model as offered, its health is 200
`standby`), and the next request, one naming no model included, has it loaded again and is answered
whole; a kept session holds its model loaded until the session's TTL ends it; a request for another
model of the folder loads that one from standby. A request's own `keep_alive` (Ollama's) lengthens its
tenant's stay from then on, within --keep-alive-max: -1 keeps the model loaded past the worker's
keep-alive, and the same tenant's 0 takes that back; another tenant's 0 never unloads it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.scale_bench import rss_kib
from tests.conftest import free_port
from tests.integration.conftest import Proc, alive_worker, folder_pool, start_coordinator, stop_all
from tests.polling import wait_until

pytestmark = pytest.mark.model
SMOL, GEMMA = "smollm2-135m-8k-lc100k-mix1-ep2", "gemma-3-270m"
KEEP_ALIVE, TTL = 1.0, 3.0


@pytest.fixture(scope="module")
def pool(model_path: Path, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc]]:
    with folder_pool(tmp_path_factory.mktemp("keep-alive"), model_path, gemma_path, "idle", "--keep-alive",
                     str(KEEP_ALIVE), "--session-ttl", str(TTL)) as (url, worker, _):
        yield url, worker


def listing(url: str, worker_id: str = "idle") -> dict[str, Any] | None:
    return alive_worker(url, worker_id)


def standby(url: str, worker_id: str = "idle") -> bool:
    return bool((listing(url, worker_id) or {}).get("standby"))


def answer(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """(the model that answered, the stream's event names)."""
    with httpx.stream("POST", url + "/coordinator/infer", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
        return response.headers.get("x-model", ""), events


def test_an_idle_model_is_unloaded_and_the_next_request_loads_it_again(pool: tuple[str, Proc], model_path: Path) -> None:
    url, worker = pool
    assert worker.popen is not None
    wait_until(lambda: standby(url), 20, "the idle model to be unloaded", interval=0.2)
    models = {m["id"]: m.get("state") for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]}
    assert models == {SMOL: "offered", GEMMA: "offered"}, models
    info = listing(url)
    assert info is not None and info["draining"] and info["model"] == SMOL
    health = httpx.get(info["url"] + "/worker/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "standby", health.text

    # No model named: the one the pool knows is loaded again. The session keeps it loaded past the keep-alive.
    _, events = answer(url, {"prompt": "Say hi.", "max_tokens": 8, "session_id": "kept", "temperature": 0})
    assert events[-1] == "done", events
    loaded_kib = rss_kib(worker.popen.pid)
    ended = time.monotonic()
    time.sleep(KEEP_ALIVE + 1)
    assert not standby(url) and (listing(url) or {}).get("sessions") == 1, listing(url)
    wait_until(lambda: standby(url), TTL + 10, "the model to be unloaded once the session expired", interval=0.2)
    assert time.monotonic() - ended >= TTL - 0.5  # not before the session's TTL
    standby_kib = rss_kib(worker.popen.pid)
    assert standby_kib < loaded_kib - model_path.stat().st_size / 2048, (loaded_kib, standby_kib)

    # Another model of the folder, from standby, asked to stay loaded; then to go as soon as it is idle.
    _, events = answer(url, {"prompt": "Say hi.", "max_tokens": 8, "model": GEMMA, "keep_alive": -1})
    assert events[-1] == "done", events
    wait_until(lambda: (listing(url) or {}).get("model") == GEMMA, 10, "gemma served", interval=0.2)
    time.sleep(KEEP_ALIVE + 1)
    assert not standby(url)
    _, events = answer(url, {"prompt": "Say hi.", "max_tokens": 4, "model": GEMMA, "keep_alive": 0})
    assert events[-1] == "done", events
    wait_until(lambda: standby(url), 5, "the model unloaded once idle, as its last request asked", interval=0.1)


def test_one_tenants_keep_alive_never_unloads_the_model_another_tenant_uses(
        model_path: Path, gemma_path: Path, tmp_path: Path) -> None:
    """Issue 50: with two tenants' keys, tenant A's `keep_alive: 0` unloaded the model tenant B was using
    (B's next chat a cold load, 1.29 s instead of 0.05 s), and A's `-1` pinned it. Residency is the
    operator's: a request only lengthens its own tenant's stay, within --keep-alive-max."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a-smol.gguf").symlink_to(model_path)
    (folder / "b-gemma.gguf").symlink_to(gemma_path)
    coordinator, url = start_coordinator(tmp_path, "coordinator-tenants", "--heartbeat-interval", "1",
                                         "--api-keys", "alpha-key alpha,beta-key beta")
    worker = Proc("tenants", [sys.executable, "-m", "worker", "--port", str(free_port()), "--worker-id", "tenants",
                              "--coordinator-url", url, "--model-dir", str(folder), "--threads", "1",
                              "--heartbeat-interval", "0.5", "--keep-alive", "1", "--keep-alive-max", "4"],
                  tmp_path / "tenants.log")
    worker.start()

    def chat(key: str, **more: Any) -> float:
        started = time.monotonic()
        answer = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                            json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **more})
        assert answer.status_code == 200, answer.text
        return time.monotonic() - started

    try:
        wait_until(lambda: alive_worker(url, "tenants") is not None, 60, "the worker to register", interval=0.2)
        chat("beta-key", keep_alive=30)  # beta's stay: 30 s asked, 4 s granted (the operator's bound)
        chat("alpha-key", keep_alive=0)  # before: the model unloaded as soon as it was idle
        time.sleep(2.5)  # past the worker's own keep-alive (1 s), within beta's stay
        assert not standby(url, "tenants"), listing(url, "tenants")
        warm = chat("beta-key")
        assert warm < 1.0, warm  # no cold load
        # alpha's -1 pins nothing here: its stay is the bound, and the model goes once that ran out.
        chat("alpha-key", keep_alive=-1)
        gone_by = time.monotonic() + 4
        wait_until(lambda: standby(url, "tenants"), 15, "the model unloaded once every stay ran out", interval=0.2)
        assert time.monotonic() >= gone_by - 0.5  # not before alpha's bounded stay
    finally:
        stop_all([worker, coordinator])
