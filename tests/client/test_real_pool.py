"""The batch client as a real process against a real coordinator and two real workers serving the
real model: results, resumption (a rerun sends nothing, counted on the coordinator's /metrics), a
failure exit and its rerun, a run interrupted and resumed, and a chat job through the OpenAI surface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.processes import Pool, pool
from tests.conftest import WITH_DEFAULT_SIGINT
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Write one short sentence about the number {i}." for i in range(20)]


@pytest.fixture(scope="module")
def stack(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    worker = ["--threads", "1", "--model-path", str(model_path), "--max-sessions", "4"]
    with pool(tmp_path_factory.mktemp("client-pool"), workers=[worker, worker], name="client") as running:
        yield running


def argv(jobs: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "client", "batch", str(jobs), "--url", url, "--output", str(out),
            "--no-progress", *extra]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("COORDINATOR_URL", "LLM_API_KEY")}


def batch(jobs: Path, url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(jobs, url, out, *extra), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=240, check=False)


def requests_seen(url: str) -> float:
    """Requests the coordinator has decided on (admitted or refused), from its /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("coordinator_admission_decisions_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def records(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_batch_runs_and_a_rerun_sends_nothing(stack: Pool, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "results.jsonl"
    before = requests_seen(stack.url)
    first = batch(jobs, stack.url, out, "--max-tokens", "8", "--concurrency", "4")
    assert first.returncode == 0, first.stdout + first.stderr
    assert requests_seen(stack.url) - before == len(PROMPTS)
    got = records(out)
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))
    assert [r["prompt"] for r in got] == PROMPTS
    for r in got:
        assert r["error"] is None and r["text"] and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["tokens"]["completion"] <= 8 and r["tokens"]["prompt"] > 0
        assert r["worker"] in ("w1", "w2") and r["model"]
        assert 0 < r["timings"]["ttft_ms"] <= r["timings"]["total_ms"]
    assert {r["worker"] for r in got} == {"w1", "w2"}  # four at a time spread over both workers
    assert f"{len(PROMPTS)} ok, 0 failed, 0 skipped" in first.stdout

    seen = requests_seen(stack.url)
    again = batch(jobs, stack.url, out, "--max-tokens", "8")
    assert again.returncode == 0, again.stderr
    assert requests_seen(stack.url) == seen  # nothing re-sent
    assert f"0 ok, 0 failed, {len(PROMPTS)} skipped" in again.stdout
    assert records(out) == got


def test_a_job_that_fails_for_good_gives_a_failure_exit_and_a_rerun_sends_only_it(stack: Pool,
                                                                                  tmp_path: Path) -> None:
    lines = [{"id": f"job-{i}", "prompt": p, "max_tokens": 4} for i, p in enumerate(PROMPTS[:6])]
    lines[3]["model"] = "no-such-model"
    lines.append({"id": "chat", "messages": [{"role": "system", "content": "Answer in one word."},
                                             {"role": "user", "content": "Name a colour."}], "max_tokens": 4})
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    first = batch(jobs, stack.url, out, "--concurrency", "3")
    assert first.returncode == 1, first.stdout + first.stderr
    by_id = {r["id"]: r for r in records(out)}
    assert by_id["job-3"]["error"]["status"] == 404 and by_id["job-3"]["error"]["reason"] == "unknown_model"
    assert by_id["job-3"]["attempts"] == 1  # a 404 is not retried
    assert all(r["error"] is None for i, r in by_id.items() if i != "job-3")
    chat = by_id["chat"]
    assert "messages" in chat and chat["text"] and chat["worker"] in ("w1", "w2")
    assert 1 <= chat["tokens"]["completion"] <= 4

    del lines[3]["model"]
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seen = requests_seen(stack.url)
    second = batch(jobs, stack.url, out)
    assert second.returncode == 0, second.stdout + second.stderr
    assert requests_seen(stack.url) - seen == 1
    final = records(out)
    assert len(final) == len(lines) and all(r["error"] is None for r in final)  # compacted: one line per job


def test_an_interrupted_run_resumes_where_it_stopped(stack: Pool, tmp_path: Path) -> None:
    # Long enough that the interrupt always lands mid-run, however fast the pool is.
    prompts = [f"Write one short sentence about the number {i}." for i in range(40)]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "results.jsonl"
    before = requests_seen(stack.url)
    proc = subprocess.Popen([*WITH_DEFAULT_SIGINT, *argv(jobs, stack.url, out, "--max-tokens", "8",
                                                         "--concurrency", "1")], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 5, 120, "5 results")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, stderr
    assert "the same command resumes" in stderr
    written = len(records(out))
    assert 5 <= written < len(prompts)

    resumed = batch(jobs, stack.url, out, "--max-tokens", "8", "--concurrency", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{written} skipped" in resumed.stdout
    got = records(out)
    assert [r["index"] for r in got] == list(range(len(prompts))) and all(r["error"] is None for r in got)
    # Each job reached the pool once, except at most the one in flight when the run was interrupted.
    time.sleep(0.5)
    assert len(prompts) <= requests_seen(stack.url) - before <= len(prompts) + 1
