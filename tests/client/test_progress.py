"""The live tallies and their rendering."""

from __future__ import annotations

import io
import random
from pathlib import Path

from rich.console import Console

from client.jobs import parse_jobs
from client.progress import MAX_WORKER_ROWS, OTHERS, BatchStats, render, save_frame
from client.results import JobError, Result

JOBS = parse_jobs("".join(f"p{i}\n" for i in range(400)))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def text_of(stats: BatchStats) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render(stats, "title"))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_counts_match_a_recount_after_random_job_lifecycles() -> None:
    rng = random.Random(5)
    stats = BatchStats(total=len(JOBS) + 10, skipped=10, clock=Clock())
    expected_done: dict[str, int] = {}
    expected_tokens = 0
    ok = failed = retries = 0
    for job in JOBS:
        for _ in range(rng.randrange(3)):
            stats.retrying(job, 1.0, "queue_full")
            retries += 1
        worker = rng.choice(["w1", "w2", "w3", None])  # None: refused before any worker was chosen
        if worker is not None:
            stats.started(job, worker)
            for _ in range(rng.randrange(5)):
                stats.token(job, worker)
                expected_tokens += 1
        result = Result(job, worker=worker, ttft_ms=10.0)
        if worker is None or rng.random() < 0.2:
            result.error = JobError("queue_full" if worker is None else "worker_failed", "x", None)
            failed += 1
        else:
            ok += 1
            expected_done[worker] = expected_done.get(worker, 0) + 1
        stats.finished(result)
    assert (stats.ok, stats.failed, stats.retries, stats.tokens) == (ok, failed, retries, expected_tokens)
    assert stats.completed == stats.total and stats.running == 0 and stats.waiting == 0
    assert {w: t.done for w, t in stats.workers.items() if t.done} == expected_done
    assert all(t.running == 0 for t in stats.workers.values())
    assert sum(stats.failures.values()) == failed


def test_the_frame_shows_totals_and_a_row_per_worker() -> None:
    clock = Clock()
    stats = BatchStats(total=5, skipped=1, clock=clock)
    stats.started(JOBS[0], "worker-a")
    stats.started(JOBS[1], "worker-b")
    stats.token(JOBS[0], "worker-a")
    stats.finished(Result(JOBS[0], worker="worker-a", ttft_ms=42.0))
    clock.now += 2
    text = text_of(stats)
    assert "2/5 jobs" in text and "ok 1" in text and "skipped 1" in text and "running 1" in text
    rows = {line.split()[2]: line for line in text.splitlines() if "● worker-" in line}
    assert set(rows) == {"worker-a", "worker-b"}
    assert "42 ms" in rows["worker-a"]


def test_worker_rows_are_bounded() -> None:
    stats = BatchStats(total=len(JOBS), skipped=0, clock=Clock())
    for i, job in enumerate(JOBS[:100]):
        stats.started(job, f"w{i}")
        stats.finished(Result(job, worker=f"w{i}"))
    assert len(stats.workers) == MAX_WORKER_ROWS
    assert stats.workers[OTHERS].done == 100 - (MAX_WORKER_ROWS - 1)


def test_a_frame_is_saved_as_svg_or_text(tmp_path: Path) -> None:
    stats = BatchStats(total=1, skipped=0, clock=Clock())
    stats.finished(Result(JOBS[0], worker="w1"))
    save_frame(render(stats, "llm-batch"), tmp_path / "f.svg")
    save_frame(render(stats, "llm-batch"), tmp_path / "f.txt")
    assert (tmp_path / "f.svg").read_text().startswith("<svg")
    assert "1/1 jobs" in (tmp_path / "f.txt").read_text()
