"""With a worker token set, only its holder (the coordinator) may generate or delete sessions; before,
`/worker/generate` and `DELETE /worker/sessions/{id}` needed no credentials even then."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.sse import generate
from tests.worker.server import running_worker

TOKEN = "w-secret"


def test_generate_and_delete_need_the_worker_token_when_one_is_set(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0,
                        worker_token=TOKEN) as worker:
        body = {"prompt": "Hi", "max_tokens": 3, "session_id": "s1"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            refused = generate(worker.url, body, headers=headers)
            assert refused.status == 401 and refused.body is not None and refused.body["reason"] == "unauthorized"
        served = generate(worker.url, body, headers={"authorization": f"Bearer {TOKEN}"})
        assert served.status == 200 and served.last[0] == "done"
        assert httpx.delete(worker.url + "/worker/sessions/s1", timeout=5).status_code == 401
        assert httpx.delete(worker.url + "/worker/sessions/s1", timeout=5,
                            headers={"authorization": f"Bearer {TOKEN}"}).status_code == 204
        assert httpx.get(worker.url + "/worker/health", timeout=5).status_code == 200  # health stays open


def test_without_a_token_the_worker_is_open_as_before(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as worker:
        assert generate(worker.url, {"prompt": "Hi", "max_tokens": 2}).status == 200
