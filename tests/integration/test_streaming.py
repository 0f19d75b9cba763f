"""End to end through the real coordinator and two real workers: streaming, spreading, bad input."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import TOKEN, Cluster
from tests.integration.streams import infer

pytestmark = [pytest.mark.model, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[2]


def test_curl_streams_tokens_then_done(cluster: Cluster) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(
        [curl, "-sN", "-D", "-", "--max-time", "60", cluster.url + "/coordinator/infer", "-H",
         "content-type: application/json", "-H", "x-request-id: curl-1", "-d",
         json.dumps({"prompt": "Name three colors.", "max_tokens": 16, "seed": 1})],
        capture_output=True, text=True, timeout=90, check=True).stdout
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "text/event-stream" in head and "x-request-id: curl-1" in head
    blocks = [b for b in body.split("\n\n") if b.strip() and not b.startswith(":")]
    names = [b.split("\n")[0] for b in blocks]
    assert names[-1] == "event: done" and set(names[:-1]) == {"event: token"} and len(names) >= 2
    first = json.loads(blocks[0].split("\n")[1].removeprefix("data: "))
    assert set(first) >= {"token", "index", "probability", "finished"} and first["finished"] is False
    done = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert done["finished"] is True and done["finish_reason"] in ("stop", "length")
    assert done["request_id"] == "curl-1" and done["worker_id"] in cluster.workers
    assert done["usage"]["completion_tokens"] == len(blocks) - 1 or done["finish_reason"] == "stop"


def test_the_command_line_client(cluster: Cluster) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "test_inference.py"), "--url", cluster.url,
                          "Say hello.", "12"], check=False, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    assert "TTFT" in run.stdout and "tokens/s" in run.stdout and "worker w" in run.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "test_inference.py"), "--url", cluster.url,
                              "--model", "nope", "hi"], check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and '"reason":"unknown_model"' in refused.stderr.replace(" ", "")


async def test_load_spreads_by_score(cluster: Cluster) -> None:
    body = {"prompt": "Tell me a story.", "max_tokens": 24, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        streams = await asyncio.gather(*[infer(client, cluster.url, body) for _ in range(4)])
    assert all(s.status == 200 and s.names[-1] == "done" for s in streams)
    assert Counter(s.headers["x-worker-id"] for s in streams) == {"w1": 2, "w2": 2}


def test_health_lists_workers_with_their_60_40_score(cluster: Cluster) -> None:
    for worker in cluster.states().values():
        expected = 0.6 * worker["sessions"] / worker["max_sessions"] + \
            0.4 * worker["kv_reserved_bytes"] / worker["kv_capacity_bytes"]
        assert worker["state"] == "alive" and worker["heartbeat_age_s"] < 1.5
        assert worker["score"] == pytest.approx(expected, abs=1e-6)
        assert worker["bytes_per_token"] == 23040
    health = cluster.coordinator_health()
    assert health["status"] == "ok" and health["workers"] == {"alive": 2, "stale": 0, "total": 2}


async def test_a_session_stays_on_its_worker(cluster: Cluster) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        first = await infer(client, cluster.url, {"prompt": "My name is Ada.", "max_tokens": 4,
                                                  "session_id": "ada-1"})
        # Load the session's worker so the score alone would send the next turn elsewhere.
        other = await infer(client, cluster.url, {"prompt": "Hi", "max_tokens": 4, "session_id": "bob-1"})
        again = await infer(client, cluster.url, {"prompt": "What is my name?", "max_tokens": 4,
                                                  "session_id": "ada-1"})
        assert first.status == other.status == again.status == 200
        assert again.headers["x-worker-id"] == first.headers["x-worker-id"] != other.headers["x-worker-id"]
        assert again.events[-1][1]["usage"]["cached_tokens"] > 0
        for url in cluster.worker_urls.values():
            for session_id in ("ada-1", "bob-1"):
                gone = await client.delete(f"{url}/worker/sessions/{session_id}",
                                           headers={"authorization": f"Bearer {TOKEN}"})
                assert gone.status_code in (204, 404)


@pytest.mark.parametrize(("body", "status", "reason"), [
    (b"{not json", 400, "invalid_request"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "unknown_model"),
    (json.dumps({"prompt": "hello " * 1200, "max_tokens": 4}).encode(), 413, "prompt_too_long"),
])
def test_bad_input_gets_a_json_error(cluster: Cluster, body: bytes, status: int, reason: str) -> None:
    response = httpx.post(cluster.url + "/coordinator/infer", content=body, timeout=30,
                          headers={"content-type": "application/json", "x-request-id": "bad-input"})
    assert response.status_code == status
    assert response.json()["reason"] == reason and response.json()["request_id"] == "bad-input"
    assert response.headers["x-request-id"] == "bad-input"
