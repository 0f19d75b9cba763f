"""Swaps under traffic (issue 37), with a real coordinator and a real worker offering a folder (SmolLM2
served, Gemma offered):
- requests for both models at once, on that one worker, are all answered: the worker swaps back and
  forth, and a request for the model being swapped away or to waits for the swap (the worker's heartbeats
  go on through it, saying where it goes) rather than being refused for want of a worker;
- a kept conversation outlives its model's unload: with a second real worker serving SmolLM2, the
  folder worker holding three kept sessions is asked to swap to Gemma; it drains, the coordinator moves
  each kept session to the other worker of its model, with its KV, so every next turn is served there
  with its history reused, never as a 404 or a full prefill."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import Proc, start_coordinator, stop_all
from tests.integration.test_session_moves import HISTORY
from tests.polling import wait_until

pytestmark = pytest.mark.model
TOKEN = "t0ken"
LIMITS = ["--max-sessions", "4", "--session-max-tokens", "1024", "--threads", "1", "--heartbeat-interval", "0.5",
          "--worker-token", TOKEN]
GEMMA = "gemma-3-270m"


class Pool:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.coordinator, self.url = start_coordinator(log_dir, "coordinator-swap-moves", "--heartbeat-interval",
                                                       "0.5", "--worker-token", TOKEN)
        self.workers: list[Proc] = []

    def start(self, worker_id: str, *model: str) -> str:
        port = free_port()
        proc = Proc(worker_id, [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", worker_id,
                                "--coordinator-url", self.url, *model, *LIMITS], self.log_dir / f"{worker_id}.log")
        proc.start()
        self.workers.append(proc)
        wait_until(lambda: self.model(worker_id) is not None, 60, f"{worker_id} alive", interval=0.2)
        return f"http://127.0.0.1:{port}"

    def model(self, worker_id: str) -> str | None:
        """The model the worker serves, while it is alive and not draining."""
        listing = httpx.get(self.url + "/coordinator/health/workers", timeout=2).json()["workers"]
        return next((w["model"] for w in listing if w["worker_id"] == worker_id and w["state"] == "alive"
                     and not w["draining"]), None)

    def turn(self, session_id: str, prompt: str, model: str) -> tuple[str, dict[str, int]]:
        """(the worker that served it, the usage in its `done` event)."""
        with httpx.stream("POST", self.url + "/coordinator/infer", timeout=60, json={
                "model": model, "prompt": prompt, "session_id": session_id, "max_tokens": 8,
                "temperature": 0}) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            worker = response.headers["x-worker-id"]
        done = json.loads(lines[-1][6:])
        assert done.get("finished") and "usage" in done, done
        usage = done["usage"]
        return worker, {"held": usage["prompt_tokens"] + usage["completion_tokens"], "cached": usage["cached_tokens"]}

    def stop(self) -> None:
        stop_all([*self.workers, self.coordinator])


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    running = Pool(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def folder_of(tmp_path: Path, model_path: Path, gemma_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a-smol.gguf").symlink_to(model_path)
    (folder / "b-gemma.gguf").symlink_to(gemma_path)
    return folder


def test_requests_for_two_models_on_one_worker_are_all_answered_across_its_swaps(
        pool: Pool, model_path: Path, gemma_path: Path, tmp_path: Path) -> None:
    folder_url = pool.start("folder", "--model-dir", str(folder_of(tmp_path, model_path, gemma_path)))
    smol = pool.model("folder")

    def ask(model: str) -> httpx.Response:
        return httpx.post(pool.url + "/v1/chat/completions", timeout=90, json={
            "model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})

    with ThreadPoolExecutor(6) as threads:
        for _ in range(2):  # each round: one swap each way at least
            answers = list(threads.map(ask, ["a-smol", GEMMA, "b-gemma", smol, GEMMA, "a-smol"]))
            assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers if a.status_code != 200]
            assert [a.json()["model"] for a in answers] == [smol, GEMMA, GEMMA, smol, GEMMA, smol]
    metrics = httpx.get(folder_url + "/metrics", timeout=5, headers={"authorization": f"Bearer {TOKEN}"}).text
    swaps = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith('worker_model_swaps_total{outcome="loaded"}'))
    assert swaps >= 2


def test_kept_sessions_move_to_another_worker_of_their_model_when_theirs_swaps(
        pool: Pool, model_path: Path, gemma_path: Path, tmp_path: Path) -> None:
    folder_url = pool.start("folder", "--model-dir", str(folder_of(tmp_path, model_path, gemma_path)))
    smol = pool.model("folder")
    held: dict[str, int] = {}
    for i in range(3):  # the folder worker is the only one: every session is kept there
        served, usage = pool.turn(f"tutor-{i}", f"{HISTORY} Question {i}: what is {i} plus {i}?", "a-smol")
        assert served == "folder"
        held[f"tutor-{i}"] = usage["held"]
    pool.start("plain", "--model-path", str(model_path))
    asked = httpx.post(folder_url + "/worker/models/load", json={"model": GEMMA}, timeout=10,
                       headers={"authorization": f"Bearer {TOKEN}"})
    assert asked.status_code == 202, asked.text
    wait_until(lambda: pool.model("folder") == GEMMA, 90, "the folder worker to serve gemma", interval=0.2)
    for sid, tokens in held.items():
        served, usage = pool.turn(sid, "And why?", "a-smol")
        # Served by the other worker of its model, with its history: at most a token prefilled again.
        assert served == "plain" and usage["cached"] >= 0.9 * tokens, (sid, served, usage, tokens)
    assert pool.model("plain") == smol
    metrics = httpx.get(pool.url + "/metrics", timeout=5).text
    moved = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith('coordinator_session_moves_total{outcome="moved"}'))
    assert moved >= len(held)
