"""Live progress of a batch: the tallies, overall and per worker, and how rich draws them.

Owns: `BatchStats` (counts moved by the job observer calls; no I/O), its rendering as one rich
panel (an overall bar, then one coloured row per worker the pool routed jobs to), and saving a final
frame as SVG or text.
Must not: run jobs or touch files other than the one `save_frame` is given.

The worker of a job is the `X-Worker-ID` header of its answer (the `done` event's `worker_id` once it
ends), so rows appear as the pool spreads the jobs. Rows are bounded (`MAX_WORKER_ROWS`): a pool with
more workers folds the rest into one row.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from client.jobs import Job
from client.results import Result

MAX_WORKER_ROWS = 32
OTHERS = "(others)"
PALETTE = ("cyan", "magenta", "green", "yellow", "bright_blue", "red", "bright_cyan", "bright_magenta",
           "bright_green", "bright_yellow", "blue", "bright_red")


@dataclass
class WorkerTally:
    name: str
    colour: str
    running: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    ttft_ms_sum: float = 0.0
    ttft_count: int = 0

    @property
    def avg_ttft_ms(self) -> float | None:
        return self.ttft_ms_sum / self.ttft_count if self.ttft_count else None


class BatchStats:
    """The batch's counts; the job observer of `client.stream` plus `finished` for each result."""

    def __init__(self, total: int, skipped: int, clock: Callable[[], float]) -> None:
        self.total = total
        self.skipped = skipped
        self.clock = clock
        self.started_at = clock()
        self.ended_at: float | None = None
        self.ok = 0
        self.failed = 0
        self.retries = 0
        self.tokens = 0
        self.failures: Counter[str] = Counter()
        self.workers: dict[str, WorkerTally] = {}
        self._running: dict[str, str | None] = {}  # job key -> its worker
        self._waiting: set[str] = set()  # job keys sleeping before a retry

    # -- the observer ---------------------------------------------------------------------------------

    def started(self, job: Job, worker: str | None) -> None:
        self._waiting.discard(job.key)
        self._running[job.key] = worker
        if worker is not None:
            self._tally(worker).running += 1

    def token(self, job: Job, worker: str | None) -> None:
        self.tokens += 1
        if worker is not None:
            self._tally(worker).tokens += 1

    def retrying(self, job: Job, delay: float, reason: str) -> None:
        self.retries += 1
        self._waiting.add(job.key)

    def finished(self, result: Result) -> None:
        key = result.job.key
        self._waiting.discard(key)
        header_worker = self._running.pop(key, None)
        if header_worker is not None:
            self._tally(header_worker).running -= 1
        if result.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.failures[result.error.reason if result.error else "unknown"] += 1
        worker = result.worker or header_worker
        if worker is None:
            return
        tally = self._tally(worker)
        if result.ok:
            tally.done += 1
            if result.ttft_ms is not None:
                tally.ttft_ms_sum += result.ttft_ms
                tally.ttft_count += 1
        else:
            tally.failed += 1

    def end(self) -> None:
        self.ended_at = self.clock()

    # -- reading --------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def completed(self) -> int:
        return self.skipped + self.ok + self.failed

    @property
    def elapsed(self) -> float:
        return (self.ended_at if self.ended_at is not None else self.clock()) - self.started_at

    def _tally(self, worker: str) -> WorkerTally:
        tally = self.workers.get(worker)
        if tally is None:
            if len(self.workers) >= MAX_WORKER_ROWS - 1 and worker != OTHERS:
                return self._tally(OTHERS)
            tally = self.workers[worker] = WorkerTally(worker, PALETTE[len(self.workers) % len(PALETTE)])
        return tally


def render(stats: BatchStats, title: str) -> RenderableType:
    """One frame: the overall bar and counts, then a row per worker."""
    elapsed = stats.elapsed
    ran = stats.ok + stats.failed
    to_run = stats.total - stats.skipped
    rate = ran / elapsed if elapsed > 0 else 0.0
    eta = (to_run - ran) / rate if rate > 0 else None
    bar = ProgressBar(total=max(stats.total, 1), completed=stats.completed, width=None,
                      complete_style="red" if stats.failed else "green", finished_style="bold green")
    overall = Table.grid(expand=True, padding=(0, 1))
    overall.add_column(ratio=1)
    overall.add_column(justify="right", no_wrap=True)
    overall.add_row(bar, Text(f"{stats.completed}/{stats.total} jobs {stats.completed / max(stats.total, 1):4.0%}",
                              style="bold"))
    counts = Text.assemble(
        ("ok ", "dim"), (f"{stats.ok}   ", "green"),
        ("failed ", "dim"), (f"{stats.failed}   ", "bold red" if stats.failed else "green"),
        ("skipped ", "dim"), (f"{stats.skipped}   ", ""),
        ("running ", "dim"), (f"{stats.running}   ", "cyan"),
        ("waiting to retry ", "dim"), (f"{stats.waiting}", "yellow"), (f" ({stats.retries} retries)", "dim"))
    pace = Text.assemble(
        ("tokens ", "dim"), (f"{stats.tokens}   ", ""),
        ("jobs/s ", "dim"), (f"{rate:.2f}   ", ""),
        ("elapsed ", "dim"), (_clock(elapsed), ""),
        ("   eta ", "dim"), (_clock(eta) if eta is not None and stats.ended_at is None else "-", ""))
    parts: list[RenderableType] = [overall, counts, pace]
    if stats.failures:
        parts.append(Text("failures: " + ", ".join(f"{reason} {n}" for reason, n in stats.failures.most_common()),
                          style="red"))
    if stats.workers:
        parts += [Text(), _worker_table(stats, elapsed)]
    return Panel(Group(*parts), title=title, title_align="left", border_style="blue", padding=(0, 1))


def _worker_table(stats: BatchStats, elapsed: float) -> Table:
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
    table.add_column("worker", no_wrap=True)
    table.add_column("jobs", justify="right")
    table.add_column("share", ratio=1)
    table.add_column("running", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("avg TTFT", justify="right")
    served = max(sum(t.done for t in stats.workers.values()), 1)
    for tally in stats.workers.values():
        avg = tally.avg_ttft_ms
        table.add_row(
            Text("● " + tally.name, style=f"bold {tally.colour}"),
            str(tally.done),
            ProgressBar(total=served, completed=tally.done, width=None, complete_style=tally.colour,
                        finished_style=tally.colour),
            str(tally.running),
            Text(str(tally.failed), style="red" if tally.failed else ""),
            str(tally.tokens),
            f"{tally.tokens / elapsed:.1f}" if elapsed > 0 else "-",
            f"{avg:.0f} ms" if avg is not None else "-")
    return table


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def save_frame(frame: RenderableType, path: Path, width: int = 110) -> None:
    """Writes one frame to `path`: SVG when it ends in .svg, else plain text."""
    console = Console(record=True, file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor")
    console.print(frame)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".svg":
        console.save_svg(str(path), title="llm-batch")
    else:
        console.save_text(str(path))
