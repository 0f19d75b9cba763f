"""The Batch API end to end: the official `openai` client uploads a JSONL and runs a batch on the real
coordinator and a real worker running the real model; a coordinator killed mid-job and started again on
the same BATCH_DIR finishes the job with every line in the output once."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import free_port
from tests.integration.conftest import (
    TOKEN,
    WORKER_LIMITS,
    Proc,
    alive_worker,
    start_coordinator,
    start_worker,
    stop_all,
)
from tests.polling import wait_until

pytestmark = pytest.mark.model
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"


@dataclass
class BatchPool:
    log_dir: Path
    coordinator: Proc
    url: str
    port: int
    flags: tuple[str, ...]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def restart_coordinator(self) -> None:
        """Killed (SIGKILL: no lease given back), then started again on the same port and BATCH_DIR."""
        self.coordinator.signal(signal.SIGKILL)
        self.coordinator.reap()
        self.coordinator, _ = start_coordinator(self.log_dir, "coordinator-again", *self.flags, port=self.port)
        wait_until(lambda: alive_worker(self.url, "w1") is not None, 30, "the worker to register again", interval=0.2)


@pytest.fixture(scope="module")
def batch_pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchPool]:
    log_dir = tmp_path_factory.mktemp("batch-logs")
    flags = ("--heartbeat-interval", "1", "--worker-token", TOKEN, "--batch-dir", str(log_dir / "batches"),
             "--batch-lease", "2")
    port = free_port()
    coordinator, url = start_coordinator(log_dir, "coordinator", *flags, port=port)
    worker, _ = start_worker(log_dir, "w1", url, model_path, "--threads", "1", "--heartbeat-interval", "0.5",
                             "--worker-token", TOKEN, *WORKER_LIMITS)
    pool = BatchPool(log_dir, coordinator, url, port, flags)
    try:
        wait_until(lambda: alive_worker(url, "w1") is not None, 60, "the worker to register", interval=0.2)
        yield pool
    finally:
        stop_all([worker, pool.coordinator])


def chat(custom_id: str, text: str, max_tokens: int = 4, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                "max_tokens": max_tokens, "temperature": 0}})


def run(client: openai.OpenAI, lines: list[str]) -> str:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def ended(client: openai.OpenAI, batch_id: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s: {batch.request_counts}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_with_a_bad_line_and_an_unknown_url_answers_the_rest(batch_pool: BatchPool) -> None:
    client = batch_pool.client()
    lines = [chat(f"q{i}", f"Say the number {i}.") for i in range(18)]
    lines[5:5] = ["{this is not json", chat("wrong", "hi", url="/v1/nowhere")]
    batch = ended(client, run(client, lines), 30)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (20, 18, 2)
    out = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(f"q{i}" for i in range(18))
    assert all(line["response"]["status_code"] == 200 and line["response"]["body"]["choices"][0]["message"]["content"]
               for line in out)
    errors = {line["custom_id"]: line["error"]["code"] for line in lines_of(client, batch.error_file_id)}
    assert errors == {None: "invalid_json_line", "wrong": "invalid_url"}


def test_a_coordinator_killed_mid_job_and_started_again_finishes_it_each_line_once(batch_pool: BatchPool) -> None:
    client = batch_pool.client()
    total = 12
    batch_id = run(client, [chat(f"r{i}", f"Count from {i} to {i + 30}.", max_tokens=16) for i in range(total)])
    wait_until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 2, 30, "a few lines answered",
               interval=0.05)
    before = client.batches.retrieve(batch_id).request_counts
    batch_pool.restart_coordinator()
    assert before.completed < total  # killed mid-job
    client = batch_pool.client()
    batch = ended(client, batch_id, 60)
    counts = batch.request_counts
    assert (batch.status, counts.completed, counts.failed) == ("completed", total, 0), \
        lines_of(client, batch.error_file_id)[:2]
    answered = [line["custom_id"] for line in lines_of(client, batch.output_file_id)]
    assert sorted(answered) == sorted(f"r{i}" for i in range(total))  # each once: none lost, none twice
