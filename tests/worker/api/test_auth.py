"""With a worker token set, only its holder (the coordinator, or a scraper given it) may use the worker:
generate, the session listing and deletion, and `/metrics`. `/worker/health` stays open for probes.
Before, only generate and DELETE checked it; the listing (every tenant's session ids) and the
metrics were open to anyone who could reach the port."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.sse import generate
from tests.worker.server import running_worker

TOKEN = "w-secret"
GOOD = {"authorization": f"Bearer {TOKEN}"}
BAD: tuple[dict[str, str], ...] = ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN})


def test_generate_and_delete_need_the_worker_token_when_one_is_set(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0,
                        worker_token=TOKEN) as worker:
        body = {"prompt": "Hi", "max_tokens": 3, "session_id": "s1"}
        for headers in BAD:
            refused = generate(worker.url, body, headers=headers)
            assert refused.status == 401 and refused.body is not None and refused.body["reason"] == "unauthorized"
        served = generate(worker.url, body, headers=GOOD)
        assert served.status == 200 and served.last[0] == "done"
        assert httpx.delete(worker.url + "/worker/sessions/s1", timeout=5).status_code == 401
        assert httpx.delete(worker.url + "/worker/sessions/s1", timeout=5, headers=GOOD).status_code == 204


def test_sessions_and_metrics_need_it_too_and_health_stays_open(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0,
                        worker_token=TOKEN) as worker:
        request_id = {"x-request-id": "auth-1"}
        generated = generate(worker.url, {"prompt": "Hi"}, headers=request_id)
        assert generated.status == 401
        for path in ("/worker/sessions", "/metrics"):
            for headers in BAD:
                refused = httpx.get(worker.url + path, timeout=5, headers={**headers, **request_id})
                assert refused.status_code == 401, (path, headers)
                assert refused.json() == generated.body  # the same refusal as generate's, word for word
            assert httpx.get(worker.url + path, timeout=5, headers=GOOD).status_code == 200
        # Probes cannot send a secret: health answers anyone.
        assert httpx.get(worker.url + "/worker/health", timeout=5).status_code == 200


def test_without_a_token_the_worker_is_open_as_before(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as worker:
        assert generate(worker.url, {"prompt": "Hi", "max_tokens": 2}).status == 200
        for path in ("/worker/sessions", "/metrics", "/worker/health"):
            assert httpx.get(worker.url + path, timeout=5).status_code == 200, path
