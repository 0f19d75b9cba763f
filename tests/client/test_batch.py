"""A batch in-process against a faked upstream: concurrency bound, results and resumption, early stop."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from client.batch import BatchConfig, pending_jobs, run_batch
from client.jobs import parse_jobs
from client.progress import BatchStats
from client.retry import RetryPolicy
from tests.client.test_stream import SSE, infer_stream, refusal

JOBS = parse_jobs("".join(f"prompt {i}\n" for i in range(30)))


def run(tmp_path: Path, handler, concurrency: int = 4, jobs=JOBS, api_key: str | None = None):  # type: ignore[no-untyped-def]
    out = tmp_path / "results.jsonl"
    config = BatchConfig(url="http://pool", output=out, concurrency=concurrency, api_key=api_key,
                         policy=RetryPolicy(attempts=2, max_wait=5))
    todo = pending_jobs(jobs, out)
    stats = BatchStats(len(jobs), len(jobs) - len(todo), time.perf_counter)

    async def no_sleep(seconds: float) -> None:
        pass

    outcome = asyncio.run(run_batch(todo, config, stats, transport=httpx.MockTransport(handler), sleep=no_sleep))
    return outcome, stats, out


def test_jobs_run_at_most_concurrency_at_a_time_and_each_gets_one_line(tmp_path: Path) -> None:
    rng = random.Random(1)
    running = peak = 0
    prompts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(rng.random() / 50)  # jobs end out of order
        running -= 1
        prompts.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, headers=SSE, content=infer_stream(["a", "b"]))

    outcome, stats, out = run(tmp_path, handler, concurrency=3)
    assert peak == 3
    assert (outcome.sent, outcome.ok, outcome.failed, outcome.aborted) == (30, 30, 0, None)
    assert sorted(prompts) == sorted(str(j.prompt) for j in JOBS)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(30))  # compacted into job order
    assert stats.workers["w7"].done == 30 and stats.workers["w7"].running == 0 and stats.running == 0


def test_a_rerun_sends_only_the_jobs_that_failed(tmp_path: Path) -> None:
    failing = {"prompt 3", "prompt 17"}

    def flaky(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] in failing:
            return refusal(400, None, "invalid_request")
        return httpx.Response(200, headers=SSE, content=infer_stream(["a"]))

    first, _, out = run(tmp_path, flaky)
    assert (first.ok, first.failed) == (28, 2)

    resent: list[str] = []

    def healed(request: httpx.Request) -> httpx.Response:
        resent.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, headers=SSE, content=infer_stream(["a"]))

    second, stats, out = run(tmp_path, healed)
    assert sorted(resent) == sorted(failing) and stats.skipped == 28
    assert (second.sent, second.ok, second.failed) == (2, 2, 0)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 30 and all(r["error"] is None for r in records)

    third, _, _ = run(tmp_path, healed)
    assert third.sent == 0 and len(resent) == 2


def test_refused_credentials_stop_the_batch(tmp_path: Path) -> None:
    seen: list[str | None] = []

    def locked(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return refusal(401, None, "unauthorized")

    outcome, _, _ = run(tmp_path, locked, concurrency=2, api_key="k-123")
    assert outcome.aborted is not None and "credentials" in outcome.aborted
    assert outcome.sent <= 2 and len(seen) <= 2
    assert set(seen) == {"Bearer k-123"}


def test_a_client_bug_met_by_one_job_fails_that_job_and_the_batch_goes_on(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "prompt 5":
            raise RuntimeError("unexpected")
        return httpx.Response(200, headers=SSE, content=infer_stream(["a"]))

    outcome, stats, out = run(tmp_path, handler)
    assert (outcome.ok, outcome.failed) == (29, 1) and stats.failures == {"client_error": 1}
    (bad,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["error"]]
    assert bad["index"] == 5 and "unexpected" in bad["error"]["message"]
