"""The results file: one JSON object per line, one line per job, appended as each job ends.

Owns: the shape of a result line, appending lines so that a crash loses at most the line being
written, reading back which jobs a rerun may skip, and compacting the file to one line per job.
Must not: send requests or decide retries.

A line (keys in this order):
    {"index": 0, "line": 1, "id": null, "prompt": "...", "text": "...", "finish_reason": "length",
     "model": "...", "worker": "w1", "request_id": "...",
     "tokens": {"prompt": 31, "cached": 0, "completion": 16},
     "timings": {"ttft_ms": 80.1, "total_ms": 301.9, "server_ttft_ms": 75.2, "server_total_ms": 290.3,
                 "retry_wait_ms": 0.0},
     "attempts": 1, "error": null}
A chat job has "messages" in place of "prompt". A failed job has "error": {"status", "reason",
"message"} (status null when no HTTP status was received) and whatever the stream gave before.

Resuming: a job is done when the file holds a line with its key (`id`, else `index`) and no error;
a failed job runs again, and its new line is appended. Lines are appended in the order jobs end; at
the end of a run the file is compacted: the last line of each job is kept, in job order, written to a
temporary file and renamed over the old one, so the file is never half-written (a file already in
that form is left alone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from client.jobs import Job, key_of


@dataclass(frozen=True)
class JobError:
    reason: str
    message: str
    status: int | None = None


@dataclass
class Result:
    job: Job
    text: str = ""
    finish_reason: str | None = None
    model: str | None = None
    worker: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    server_ttft_ms: float | None = None
    server_total_ms: float | None = None
    retry_wait_ms: float = 0.0
    attempts: int = 0
    error: JobError | None = None
    status: int | None = None  # the last attempt's HTTP status (not written: `error` carries it)

    @property
    def ok(self) -> bool:
        return self.error is None

    def record(self) -> dict[str, Any]:
        job = self.job
        line: dict[str, Any] = {"index": job.index, "line": job.line, "id": job.id}
        if job.messages is not None:
            line["messages"] = job.messages
        else:
            line["prompt"] = job.prompt
        line.update({
            "text": self.text, "finish_reason": self.finish_reason, "model": self.model, "worker": self.worker,
            "request_id": self.request_id,
            "tokens": {"prompt": self.prompt_tokens, "cached": self.cached_tokens,
                       "completion": self.completion_tokens},
            "timings": {"ttft_ms": _ms(self.ttft_ms), "total_ms": _ms(self.total_ms),
                        "server_ttft_ms": _ms(self.server_ttft_ms), "server_total_ms": _ms(self.server_total_ms),
                        "retry_wait_ms": _ms(self.retry_wait_ms)},
            "attempts": self.attempts,
            "error": None if self.error is None else {"status": self.error.status, "reason": self.error.reason,
                                                      "message": self.error.message},
        })
        return line


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def record_key(record: dict[str, Any]) -> str | None:
    """The key of a result line read back, or None when the line is not one of ours."""
    index = record.get("index")
    if not isinstance(index, int):
        return None
    job_id = record.get("id")
    return key_of(None if job_id is None else str(job_id), index)


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every result line of `path` in file order, and how many lines could not be read (a line cut
    short by a crash, or anything else that is not a result). A missing file has none."""
    records: list[dict[str, Any]] = []
    broken = 0
    if not path.exists():
        return records, broken
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if isinstance(record, dict) and record_key(record) is not None:
                records.append(record)
            else:
                broken += 1
    return records, broken


def completed_keys(path: Path) -> set[str]:
    """Keys of the jobs `path` already holds a successful result for."""
    records, _ = read_records(path)
    latest = {record_key(r): r for r in records}
    return {key for key, r in latest.items() if key is not None and r.get("error") is None}


class ResultWriter:
    """Appends one line per result and flushes it, so what was written survives a crash."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def __enter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = self.path.exists() and self.path.stat().st_size > 0 and not _ends_with_newline(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")  # the last run died mid-line: start ours on a line of its own
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, result: Result) -> None:
        assert self._file is not None, "use ResultWriter as a context manager"
        self._file.write(json.dumps(result.record(), ensure_ascii=False) + "\n")
        self._file.flush()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def compact(path: Path) -> bool:
    """Keeps the last line of each job, in job order; returns whether the file was rewritten."""
    records, broken = read_records(path)
    latest: dict[str | None, dict[str, Any]] = {}
    for record in records:
        latest[record_key(record)] = record
    ordered = sorted(latest.values(), key=lambda r: r["index"])
    if broken == 0 and ordered == records:
        return False
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in ordered:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True
