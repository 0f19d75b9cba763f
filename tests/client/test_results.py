"""The results file: line shape, what a rerun skips, crash tolerance, compaction."""

from __future__ import annotations

import json
import random
from pathlib import Path

from client.batch import pending_jobs
from client.jobs import Job, parse_jobs
from client.results import JobError, Result, ResultWriter, compact, completed_keys, read_records

JOBS = parse_jobs('{"prompt": "p0"}\n{"id": "x", "prompt": "p1"}\n{"prompt": "p2"}\n'
                  '{"messages": [{"role": "user", "content": "p3"}]}\n')


def ok(job: Job, text: str = "t") -> Result:
    return Result(job, text=text, worker="w1", completion_tokens=3, ttft_ms=12.345, attempts=1)


def failed(job: Job) -> Result:
    return Result(job, error=JobError("queue_full", "HTTP 503: full", 503), attempts=6)


def write(path: Path, *results: Result) -> None:
    with ResultWriter(path) as writer:
        for result in results:
            writer.write(result)


def lines(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_result_line_holds_the_job_and_its_outcome(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    write(out, ok(JOBS[1]), failed(JOBS[3]))
    first, second = lines(out)
    assert first["index"] == 1 and first["line"] == 2 and first["id"] == "x" and first["prompt"] == "p1"
    assert first["text"] == "t" and first["worker"] == "w1" and first["tokens"]["completion"] == 3
    assert first["timings"]["ttft_ms"] == 12.3 and first["error"] is None
    assert second["messages"] == [{"role": "user", "content": "p3"}] and "prompt" not in second
    assert second["error"] == {"status": 503, "reason": "queue_full", "message": "HTTP 503: full"}


def test_only_successful_jobs_are_skipped_and_the_last_line_of_a_job_counts(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    assert pending_jobs(JOBS, out) == JOBS  # no file yet
    write(out, ok(JOBS[0]), failed(JOBS[1]), ok(JOBS[2]), failed(JOBS[2]))
    assert completed_keys(out) == {"index:0"}
    assert [j.index for j in pending_jobs(JOBS, out)] == [1, 2, 3]
    write(out, ok(JOBS[1]))
    assert [j.index for j in pending_jobs(JOBS, out)] == [2, 3]


def test_a_job_with_an_id_is_matched_by_id_even_when_lines_move(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    write(out, ok(JOBS[1]))
    moved = parse_jobs('{"prompt": "new first"}\n{"id": "x", "prompt": "p1"}\n')
    assert [j.key for j in pending_jobs(moved, out)] == ["index:0"]
    reordered = parse_jobs('{"id": "x", "prompt": "p1"}\n{"prompt": "new"}\n')
    assert [j.key for j in pending_jobs(reordered, out)] == ["index:1"]


def test_a_line_cut_short_by_a_crash_is_ignored_and_the_next_write_starts_a_new_line(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    write(out, ok(JOBS[0]))
    with out.open("a") as f:
        f.write('{"index": 1, "id": "x", "text": "cut sh')
    assert completed_keys(out) == {"index:0"}
    write(out, ok(JOBS[1]))
    records, broken = read_records(out)
    assert [r["index"] for r in records] == [0, 1] and broken == 1
    assert compact(out)
    assert [r["index"] for r in lines(out)] == [0, 1]


def test_compaction_keeps_the_last_line_of_each_job_in_job_order(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    rng = random.Random(3)
    history: list[Result] = []
    for _ in range(200):  # random interleavings of runs
        job = rng.choice(JOBS)
        history.append(ok(job, text=str(rng.random())) if rng.random() < 0.5 else failed(job))
    write(out, *history)
    last = {r.job.key: r.record() for r in history}
    assert compact(out)
    kept = lines(out)
    assert [r["index"] for r in kept] == sorted(r["index"] for r in last.values())
    assert {(r["index"], r["text"], json.dumps(r["error"])) for r in kept} == \
        {(r["index"], r["text"], json.dumps(r["error"])) for r in last.values()}
    before = out.read_bytes()
    assert not compact(out)  # already one line per job: left alone
    assert out.read_bytes() == before
    assert not (tmp_path / "r.jsonl.tmp").exists()


def test_compaction_puts_lines_written_as_jobs_ended_into_job_order(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    write(out, ok(JOBS[2]), ok(JOBS[0]), ok(JOBS[3]))
    assert compact(out)
    assert [r["index"] for r in lines(out)] == [0, 2, 3]
