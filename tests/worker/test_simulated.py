"""The SIMULATED engine: same API, admission and accounting as a real worker, no model."""

from __future__ import annotations

from pathlib import Path

from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import running_worker
from worker.settings import WorkerSettings


def test_simulated_engine_is_never_the_default() -> None:
    assert WorkerSettings.load([], environ={}).engine == "llama"


def test_simulated_worker_streams_accounts_and_refuses_like_a_real_one(tmp_path: Path) -> None:
    with running_worker(tmp_path / "no-model.gguf", engine="simulated", sim_token_rate=200.0,
                        max_sessions=2) as worker:
        assert worker.health()["model"] == "simulated"
        stream = generate(worker.url, {"prompt": "hello", "max_tokens": 12, "session_id": "sim-chat"})
        event, done = stream.last
        assert event == "done" and done["usage"]["completion_tokens"] == 12 == len(stream.tokens)
        assert [t["index"] for t in stream.tokens] == list(range(12))
        kept = worker.load()
        assert kept["sessions"] == 1 and kept["kv_used_bytes"] == (done["usage"]["total_tokens"] - 1) * 23040
        again = generate(worker.url, {"prompt": "more", "max_tokens": 4, "session_id": "sim-chat"})
        assert again.last[1]["usage"]["cached_tokens"] > 0
        too_long = generate(worker.url, {"prompt": "x" * 4000, "max_tokens": 4})
        assert too_long.status == 413


def test_simulated_cancel_frees_kv(tmp_path: Path) -> None:
    import httpx

    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=100.0) as worker:
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", worker.url + "/worker/generate", json={"prompt": "go", "max_tokens": 500}) as response:
            for line in response.iter_lines():
                if line.startswith("event: token"):
                    break
        wait_until(lambda: worker.load()["kv_reserved_bytes"] == 0, 3.0, "the reservation to be released")
