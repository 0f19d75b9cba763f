"""The client as a real process against a stand-in coordinator on 127.0.0.1 that refuses with 503 and
`Retry-After`: the waits honour the header, attempts and waiting are bounded, and the exit status says
whether every job succeeded."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.fake_coordinator import TOKENS, FakeCoordinator

# runs the batch client as its own process
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def batch(jobs: Path, url: str, out: Path, *extra: str, env: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("COORDINATOR_URL", "LLM_API_KEY")}
    return subprocess.run([sys.executable, "-m", "client", "batch", str(jobs), "--url", url, "--output", str(out),
                           "--no-progress", *extra], cwd=ROOT, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture
def one_job(tmp_path: Path) -> Path:
    path = tmp_path / "jobs.txt"
    path.write_text("What is the capital of France?\n")
    return path


@pytest.fixture
def fake() -> Iterator[FakeCoordinator]:
    server = FakeCoordinator()
    yield server
    server.stop()


def records(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_503s_are_retried_no_sooner_than_retry_after_then_the_job_succeeds(
        fake: FakeCoordinator, one_job: Path, tmp_path: Path) -> None:
    fake.refusals, fake.retry_after = 3, "1"
    fake.start()
    out = tmp_path / "results.jsonl"
    done = batch(one_job, fake.url, out, "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    arrivals = [a.at for a in fake.arrivals]
    assert len(arrivals) == 4
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Honoured: never before Retry-After; bounded: at most the policy's quarter of jitter more, plus slack.
    assert all(1.0 <= gap < 1.25 + 0.5 for gap in gaps), gaps
    (record,) = records(out)
    assert record["error"] is None and record["text"] == "".join(TOKENS) and record["worker"] == "fake-w1"
    assert record["attempts"] == 4 and record["timings"]["retry_wait_ms"] >= 3000
    assert fake.arrivals[0].body == {"prompt": "What is the capital of France?", "max_tokens": 4}
    assert "1 ok, 0 failed" in done.stdout and "3 retries" in done.stdout


def test_a_pool_that_always_refuses_ends_in_a_failure_exit_after_bounded_attempts(
        fake: FakeCoordinator, one_job: Path, tmp_path: Path) -> None:
    fake.refusals, fake.retry_after = None, "0"
    fake.start()
    out = tmp_path / "results.jsonl"
    done = batch(one_job, fake.url, out, "--retries", "2")
    assert done.returncode == 1, done.stderr
    assert len(fake.arrivals) == 3  # the first attempt and two retries
    (record,) = records(out)
    assert record["error"]["status"] == 503 and record["error"]["reason"] == "queue_full"
    assert record["attempts"] == 3
    assert "0 ok, 1 failed" in done.stdout and "queue_full 1" in done.stdout


def test_a_retry_after_past_the_wait_budget_fails_at_once(fake: FakeCoordinator, one_job: Path,
                                                           tmp_path: Path) -> None:
    fake.refusals, fake.retry_after = None, "60"
    fake.start()
    started = time.monotonic()
    done = batch(one_job, fake.url, tmp_path / "results.jsonl", "--max-retry-wait", "5")
    assert done.returncode == 1
    assert len(fake.arrivals) == 1 and time.monotonic() - started < 20


def test_the_api_key_is_sent_as_a_bearer_token(fake: FakeCoordinator, one_job: Path, tmp_path: Path) -> None:
    fake.start()
    assert batch(one_job, fake.url, tmp_path / "a.jsonl", "--api-key", "k-flag").returncode == 0
    assert batch(one_job, fake.url, tmp_path / "b.jsonl", env={"LLM_API_KEY": "k-env"}).returncode == 0
    assert batch(one_job, fake.url, tmp_path / "c.jsonl").returncode == 0
    assert [a.headers.get("Authorization") for a in fake.arrivals] == ["Bearer k-flag", "Bearer k-env", None]


def test_bad_job_lines_are_listed_by_number_and_nothing_is_sent(fake: FakeCoordinator, tmp_path: Path) -> None:
    fake.start()
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "fine"}\n{"prompt": "x", "max_tokens": 0}\n\n{"promt": "typo"}\n{"prompt": 3\n')
    out = tmp_path / "results.jsonl"
    done = batch(jobs, fake.url, out)
    assert done.returncode == 2
    assert "3 bad job line(s), nothing was sent" in done.stderr
    for n, text in ((2, "max_tokens"), (4, "give exactly one of prompt and messages"), (5, "not valid JSON")):
        assert f"jobs.jsonl:{n}: " in done.stderr and text in done.stderr
    assert fake.arrivals == [] and not out.exists()
