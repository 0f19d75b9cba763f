"""`llm-batch batch --via batch-api` (client/batch_api.py) against the coordinator in-process with fake
workers: the jobs go as batches (chat jobs and prompts each to their endpoint), the display counts what
the batches' request_counts say, and each job gets its result line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from client.batch import BatchConfig, pending_jobs
from client.batch_api import input_files, run_via_batch_api
from client.jobs import parse_jobs
from client.progress import BatchStats
from tests.coordinator.batches.test_api import KEYS, pool

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


CHATS = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3})
         for i in range(5)]
PROMPTS = [json.dumps({"id": f"p{i}", "prompt": f"Once upon {i}", "max_tokens": 3}) for i in range(3)]


def test_jobs_become_one_input_file_per_endpoint() -> None:
    files = input_files(parse_jobs("\n".join([*CHATS, *PROMPTS])))
    assert set(files) == {"/v1/chat/completions", "/v1/completions"}
    lines = [json.loads(line) for line in files["/v1/completions"].splitlines()]
    assert [line["custom_id"] for line in lines] == ["id:p0", "id:p1", "id:p2"]
    assert lines[0]["body"] == {"prompt": "Once upon 0", "max_tokens": 3} and lines[0]["method"] == "POST"


async def test_a_jobs_file_runs_through_the_batch_api_each_job_one_result(tmp_path: Path) -> None:
    jobs = parse_jobs("\n".join([*CHATS, *PROMPTS, json.dumps({"id": "bad", "prompt": "x", "max_tokens": 3,
                                                                 "model": "not-served"})]))
    out = tmp_path / "results.jsonl"
    async with pool(tmp_path / "store") as p:
        config = BatchConfig(url="http://coord", output=out, api_key=KEYS["A"])
        stats = BatchStats(len(jobs), 0, time.perf_counter)
        outcome = await run_via_batch_api(jobs, config, stats, transport=p.transport, poll=0.02)
    assert (outcome.sent, outcome.ok, outcome.failed, outcome.aborted) == (9, 8, 1, None)
    assert (stats.ok, stats.failed, dict(stats.failures)) == (8, 1, {"unknown_model": 1})
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["c0"]["text"] == "ok" and records["c0"]["messages"][0]["content"] == "hi 0"
    assert records["p2"]["text"] == "ok" and records["p2"]["tokens"]["completion"] == 1
    assert records["bad"]["error"]["status"] == 404 and records["bad"]["error"]["reason"] == "unknown_model"
    assert pending_jobs(jobs, out) == [jobs[-1]]  # a rerun sends only the failed job


async def test_a_key_the_pool_refuses_stops_the_run_before_anything_runs(tmp_path: Path) -> None:
    jobs = parse_jobs("\n".join(CHATS))
    async with pool(tmp_path / "store") as p:
        config = BatchConfig(url="http://coord", output=tmp_path / "results.jsonl", api_key="wrong")
        outcome = await run_via_batch_api(jobs, config, BatchStats(len(jobs), 0, time.perf_counter),
                                          transport=p.transport, poll=0.02)
    assert outcome.sent == 0 and outcome.aborted is not None and "401" in outcome.aborted
    assert p.worker.bodies == []
