"""Runs a jobs file through the pool's Batch API (`llm-batch batch --via batch-api`): one upload and one
batch per endpoint, polled until it ends, its output and error files read back into result lines.

Owns: turning jobs into Batch API input lines (a chat job to `/v1/chat/completions`, a prompt to
`/v1/completions`, each job's key as its `custom_id`), the upload, the batch, the polling that feeds the
progress display from `request_counts`, cancelling the batches when the run is interrupted, and the
result lines made from the batch's answers (a job the batch left unanswered, cancelled or expired,
fails with the batch's status as its reason, and a rerun sends it again).
Must not: parse the jobs file, draw, or write the results file's shape (`jobs`, `progress`, `results`).

Unlike the streaming mode, the pool runs the jobs at its own pace, in the `batch` priority class: on
the capacity interactive traffic leaves idle, parked for it when it needs the sequences.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from client.batch import BatchConfig, BatchOutcome
from client.jobs import Job, Surface
from client.progress import BatchStats
from client.results import JobError, Result, ResultWriter, compact

ENDPOINTS = {Surface.CHAT: "/v1/chat/completions", Surface.INFER: "/v1/completions"}
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
POLL = 1.0  # seconds between looks at the batches' request_counts


class BatchApiError(Exception):
    """The pool refused the upload or the batch: (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def input_files(jobs: list[Job]) -> dict[str, bytes]:
    """The Batch API's input JSONL of `jobs`, one file per endpoint they go to."""
    files: dict[str, list[str]] = {}
    for job in jobs:
        endpoint = ENDPOINTS[job.surface]
        files.setdefault(endpoint, []).append(json.dumps(
            {"custom_id": job.key, "method": "POST", "url": endpoint, "body": job.body}))
    return {endpoint: ("\n".join(lines) + "\n").encode() for endpoint, lines in files.items()}


async def run_via_batch_api(jobs: list[Job], config: BatchConfig, stats: BatchStats, *,
                            transport: httpx.AsyncBaseTransport | None = None, poll: float = POLL,
                            sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> BatchOutcome:
    """Submits `jobs` (already filtered by `pending_jobs`) as batches, waits for them, and appends a line
    per job to the output."""
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
    async with httpx.AsyncClient(base_url=config.url.rstrip("/"), headers=headers, timeout=timeout,
                                 transport=transport) as client:
        try:
            ids = [await _submit(client, endpoint, data) for endpoint, data in input_files(jobs).items()]
        except BatchApiError as exc:
            stats.end()
            return BatchOutcome(0, 0, 0, f"the pool refused the batch: {exc}", False)
        try:
            batches = await _until_ended(client, ids, stats, poll, sleep)
        except BaseException:  # interrupted: the pool stops the batches too
            await asyncio.shield(_cancel(client, ids))
            raise
        answers = {line["custom_id"]: line for batch in batches for line in await _lines(client, batch)}
    status = ", ".join(sorted({batch["status"] for batch in batches}))
    results = [_result(job, answers.get(job.key), status) for job in jobs]
    with ResultWriter(config.output) as writer:
        for result in results:
            writer.write(result)
    stats.ok = sum(result.ok for result in results)
    stats.failed = len(results) - stats.ok
    for result in results:
        if result.error is not None:
            stats.failures[result.error.reason] += 1
    stats.end()
    return BatchOutcome(len(jobs), stats.ok, stats.failed, None, compact(config.output))


async def _submit(client: httpx.AsyncClient, endpoint: str, data: bytes) -> str:
    uploaded = _answer(await client.post("/v1/files", files={"file": ("jobs.jsonl", data, "application/jsonl")},
                                         data={"purpose": "batch"}))
    batch = _answer(await client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                           "completion_window": "24h"}))
    return str(batch["id"])


async def _until_ended(client: httpx.AsyncClient, ids: list[str], stats: BatchStats, poll: float,
                       sleep: Callable[[float], Awaitable[None]]) -> list[dict[str, Any]]:
    """The batches once every one has ended; meanwhile the display shows their request_counts."""
    while True:
        batches = [_answer(await client.get(f"/v1/batches/{batch_id}")) for batch_id in ids]
        counts = [batch.get("request_counts") or {} for batch in batches]
        stats.ok = sum(c.get("completed", 0) for c in counts)
        stats.failed = sum(c.get("failed", 0) for c in counts)
        if all(batch["status"] in ENDED for batch in batches):
            return batches
        await sleep(poll)


async def _cancel(client: httpx.AsyncClient, ids: list[str]) -> None:
    for batch_id in ids:
        try:
            await client.post(f"/v1/batches/{batch_id}/cancel")
        except httpx.HTTPError:
            pass  # best effort: the run is ending anyway


async def _lines(client: httpx.AsyncClient, batch: dict[str, Any]) -> list[dict[str, Any]]:
    lines = []
    for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
        if file_id:
            response = await client.get(f"/v1/files/{file_id}/content")
            if response.status_code != 200:
                raise BatchApiError(response.status_code, response.text[:200])
            lines += [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return lines


def _answer(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise BatchApiError(response.status_code, message)
    body: dict[str, Any] = response.json()
    return body


def _result(job: Job, line: dict[str, Any] | None, status: str) -> Result:
    """A job's result line from its batch line (None: the batch ended without answering it)."""
    if line is None:
        return Result(job, error=JobError(f"batch_{status}", f"the batch ended ({status}) before this job ran"))
    if line.get("error"):
        return Result(job, attempts=1, error=JobError(line["error"].get("code") or "error",
                                                      line["error"].get("message") or ""))
    response = line["response"]
    body = response.get("body") or {}
    if response["status_code"] != 200:
        error = body.get("error") or {}
        return Result(job, attempts=1, request_id=response.get("request_id"), status=response["status_code"],
                      error=JobError(error.get("code") or "error", error.get("message") or "",
                                     response["status_code"]))
    return _answered(job, body, response.get("request_id"))


def _answered(job: Job, body: dict[str, Any], request_id: str | None) -> Result:
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    text = (choice.get("message") or {}).get("content") if job.surface is Surface.CHAT else choice.get("text")
    return Result(job, text=text or "", finish_reason=choice.get("finish_reason"), model=body.get("model"),
                  request_id=request_id, prompt_tokens=usage.get("prompt_tokens"),
                  cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                  completion_tokens=usage.get("completion_tokens"), attempts=1, status=200)
