"""A real worker offering a folder of models (`--model-dir`, issue 37) to a real coordinator: it serves the
first it can read, lists the others as offered, and a broken file as unavailable with its reason;
`/v1/models` shows each model's state, and a request for a model offered but served by none is a 503
naming the worker that offers it, never another model's answer. Asked to serve another model of its
folder (`POST /worker/models/load`), the worker lets the stream in flight finish whole before it swaps;
and a burst of requests for a model it offers but does not serve makes the coordinator ask for one load
and answers them all once it is served. A served model's file replaced on disk is noticed by the
folder's next read and loaded again from the file there now, after the stream in flight (the tests run in
order: each swap changes the worker's model)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, alive_worker, start_coordinator
from tests.integration.streams import Timed, infer
from tests.polling import wait_until

pytestmark = pytest.mark.model
SMOL, GEMMA = "smollm2-135m-8k-lc100k-mix1-ep2", "gemma-3-270m"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-folder") / "models"


@pytest.fixture(scope="module")
def folder_pool(model_path: Path, gemma_path: Path, folder: Path) -> Iterator[str]:
    log_dir = folder.parent
    folder.mkdir()
    (folder / "a-smol.gguf").symlink_to(model_path)
    (folder / "b-gemma.gguf").symlink_to(gemma_path)
    (folder / "c-broken.gguf").write_bytes(b"GGUF" + b"\x00" * 8)
    coordinator, url = start_coordinator(log_dir, "coordinator-folder", "--heartbeat-interval", "1")
    worker = Proc("folder", [sys.executable, "-m", "worker", "--port", str(free_port()), "--worker-id", "folder",
                             "--coordinator-url", url, "--model-dir", str(folder), "--max-sessions", "2",
                             "--session-max-tokens", "512", "--threads", "1", "--heartbeat-interval", "0.5",
                             "--model-rescan", "0.5"],
                  log_dir / "folder.log")
    worker.start()
    try:
        wait_until(lambda: listing(url) is not None, 60, "the worker to register", interval=0.2)
        yield url
    finally:
        worker.stop()
        coordinator.stop()


def listing(url: str) -> dict[str, Any] | None:
    return alive_worker(url, "folder")


async def stream_started(client: httpx.AsyncClient, url: str, tokens: int) -> asyncio.Task[Timed]:
    """A stream of `tokens` tokens from SmolLM2, once the worker runs it."""
    streaming = asyncio.create_task(infer(client, url, {
        "prompt": "Write a long story.", "max_tokens": tokens, "ignore_eos": True, "model": SMOL}))
    await asyncio.to_thread(wait_until, lambda: (listing(url) or {}).get("active_streams", 0) >= 1, 30,
                            "the stream to start", interval=0.05)
    return streaming


def test_the_worker_serves_the_first_model_and_lists_the_folder(folder_pool: str) -> None:
    worker = listing(folder_pool)
    assert worker is not None and worker["model"] == SMOL
    offered = {o["name"]: o for o in worker["offered"]}
    assert {name: o["state"] for name, o in offered.items()} == {
        SMOL: "loaded", GEMMA: "offered", "c-broken": "unavailable"}
    assert "a-smol" in offered[SMOL]["aliases"] and offered[GEMMA]["need_bytes"] > 0
    assert offered["c-broken"]["reason"] == "GGUF version 0: only versions 2 and 3 are read"
    models = httpx.get(folder_pool + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["state"]) for m in models] == [(SMOL, "loaded"), (GEMMA, "offered")]


def test_the_served_model_answers_by_its_name_or_its_files(folder_pool: str) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    served = httpx.post(folder_pool + "/v1/chat/completions", json={**body, "model": "a-smol"}, timeout=60)
    assert served.status_code == 200 and served.json()["model"] == SMOL


@pytest.mark.anyio
async def test_a_swap_waits_for_the_stream_in_flight_then_serves_the_other_model(folder_pool: str) -> None:
    worker = listing(folder_pool)
    assert worker is not None
    load = worker["url"] + "/worker/models/load"
    tokens = 96
    async with httpx.AsyncClient(timeout=120) as client:
        streaming = await stream_started(client, folder_pool, tokens)
        asked = await client.post(load, json={"model": GEMMA})
        again = await client.post(load, json={"model": "b-gemma"})  # an alias: the same swap
        third = await client.post(load, json={"model": "c-broken"})
        stream = await streaming
        assert (asked.status_code, asked.json()) == (202, {"model": GEMMA, "state": "loading"})
        assert again.status_code == 202 and third.status_code == 503 and third.json()["reason"] == "model_swapping"
        # The stream in flight when the swap was asked for ended whole, every token of it.
        assert stream.status == 200 and stream.names[-1] == "done" and stream.names.count("token") == tokens
        await asyncio.to_thread(wait_until, lambda: (listing(folder_pool) or {}).get("model") == GEMMA, 60,
                                "the worker to serve gemma", interval=0.2)
        models = (await client.get(folder_pool + "/v1/models")).json()["data"]
        assert [(m["id"], m["state"]) for m in models] == [(GEMMA, "loaded"), (SMOL, "offered")]
        answer = await client.post(folder_pool + "/v1/chat/completions", json={
            "model": GEMMA, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["model"] == GEMMA
        served = await client.post(load, json={"model": GEMMA})
        assert (served.status_code, served.json()["state"]) == (200, "loaded")
        metrics = (await client.get(worker["url"] + "/metrics")).text
    assert 'worker_model_swaps_total{outcome="loaded"} 1.0' in metrics


@pytest.mark.anyio
async def test_a_burst_for_an_offered_model_makes_one_load_and_every_request_is_answered(folder_pool: str) -> None:
    worker = listing(folder_pool)
    assert worker is not None and worker["model"] == GEMMA  # after the swap above
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(*(client.post(folder_pool + "/v1/chat/completions", json=body)
                                         for _ in range(3)))
        metrics = (await client.get(worker["url"] + "/metrics")).text
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert {a.json()["model"] for a in answers} == {SMOL}
    assert 'worker_model_swaps_total{outcome="loaded"} 2.0' in metrics  # one load for the three


@pytest.mark.anyio
async def test_a_served_file_replaced_on_disk_is_loaded_again_once_its_stream_ends(
        folder_pool: str, folder: Path, gemma_path: Path) -> None:
    worker = listing(folder_pool)
    assert worker is not None and worker["model"] == SMOL  # after the burst above
    tokens = 64
    async with httpx.AsyncClient(timeout=120) as client:
        streaming = await stream_started(client, folder_pool, tokens)
        (folder / "new.gguf").symlink_to(gemma_path)
        (folder / "new.gguf").replace(folder / "a-smol.gguf")  # the served file, replaced at once
        stream = await streaming
        assert stream.status == 200 and stream.names[-1] == "done" and stream.names.count("token") == tokens
        # The file there now holds Gemma (the name its header gives; b-gemma.gguf is named from its stem).
        await asyncio.to_thread(wait_until, lambda: (listing(folder_pool) or {}).get("model") == GEMMA, 60,
                                "the worker to serve the file there now", interval=0.2)
        offered = {o["name"]: o["state"] for o in (listing(folder_pool) or {})["offered"]}
        assert offered == {GEMMA: "loaded", "b-gemma": "offered", "c-broken": "unavailable"}, (listing(folder_pool) or {})["offered"]
        stale = await client.post(folder_pool + "/v1/chat/completions", json={
            "model": SMOL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        assert stale.status_code in (404, 503), stale.text  # the old mapping answers nothing
        metrics = (await client.get(worker["url"] + "/metrics")).text
    assert 'worker_model_swaps_total{outcome="loaded"} 3.0' in metrics
