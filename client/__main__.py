"""`python -m client batch JOBS --url URL --output RESULTS.jsonl` (also `llm-batch batch ...`).

Owns: the command line, the live display's lifetime, the summary and the exit status.
Must not: hold logic the tests need to reach without a process (that is in `batch`, `stream`, ...).

Exit status: 0 when every job has a successful result; 1 when any job failed for good (its line in
the results says why; a rerun retries it); 2 when the command line or the jobs file is wrong (every bad
line is listed with its number, and nothing is sent); 130 when interrupted (the results written so
far are kept, and a rerun resumes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from client.batch import BatchConfig, BatchOutcome, pending_jobs, run_batch
from client.batch_api import run_via_batch_api
from client.jobs import Defaults, Job, JobFileError, read_jobs
from client.progress import BatchStats, render, save_frame
from client.retry import RetryPolicy

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
API_KEY_ENV = "LLM_API_KEY"
URL_ENV = "COORDINATOR_URL"


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llm-batch", description="Clients of an llm-pool coordinator.")
    commands = top.add_subparsers(dest="command", required=True)
    p = commands.add_parser("batch", help="run a jobs file through the pool",
                            description="Run every job of JOBS through the coordinator and write one JSON "
                                        "line per job to --output; a rerun skips the jobs already done.")
    p.add_argument("jobs", type=Path, metavar="JOBS",
                   help="one prompt per line, or JSONL objects with prompt or messages and request fields")
    p.add_argument("--url", default=environ.get(URL_ENV, "http://127.0.0.1:1337"),
                   help=f"the coordinator [{URL_ENV}, default http://127.0.0.1:1337]")
    p.add_argument("--output", "-o", type=Path, required=True, metavar="RESULTS.jsonl")
    p.add_argument("--concurrency", "-c", type=_positive_int, default=4, help="jobs in flight at once (4)")
    p.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="auto: JSONL when the first non-blank line starts with '{'")
    p.add_argument("--max-tokens", type=_positive_int, help="for jobs that do not set max_tokens")
    p.add_argument("--temperature", type=float, help="for jobs that do not set temperature")
    p.add_argument("--model", help="for jobs that do not set model")
    p.add_argument("--retries", type=_positive_int, default=5,
                   help="further attempts of a refused job (503, 502, 429, unreachable) (5)")
    p.add_argument("--max-retry-wait", type=float, default=120.0,
                   help="seconds a job may spend waiting between attempts, in all (120)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds of silence on a stream before it fails")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds one attempt may take in all")
    p.add_argument("--api-key", default=environ.get(API_KEY_ENV),
                   help=f"sent as 'Authorization: Bearer KEY' [{API_KEY_ENV}]")
    p.add_argument("--via", choices=("stream", "batch-api"), default="stream",
                   help="stream: each job a request of its own, --concurrency at a time (default); batch-api: "
                        "the jobs as one batch of the pool's Batch API, run on its idle capacity at its pace, "
                        "the display fed by the batch's request_counts")
    p.add_argument("--poll", type=float, default=1.0, help="batch-api: seconds between looks at the batch (1)")
    p.add_argument("--no-progress", action="store_true", help="no live display, only the summary")
    p.add_argument("--record", type=Path, metavar="PATH",
                   help="save the final progress display to PATH (.svg, or text otherwise)")
    return top


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = parser(os.environ if environ is None else environ).parse_args(sys.argv[1:] if argv is None else argv)
    display = Console(stderr=True)  # the live display only: messages are plain lines, never wrapped
    if args.jobs.resolve() == args.output.resolve():
        _say("llm-batch: --output must not be the jobs file")
        return EXIT_USAGE
    try:
        jobs = read_jobs(args.jobs, Defaults(args.max_tokens, args.temperature, args.model), args.format)
    except OSError as exc:
        _say(f"llm-batch: cannot read {args.jobs}: {exc.strerror or exc}")
        return EXIT_USAGE
    except JobFileError as exc:
        _say(f"llm-batch: {len(exc.problems)} bad job line(s), nothing was sent:")
        _say(str(exc))
        return EXIT_USAGE
    config = BatchConfig(url=args.url, output=args.output, concurrency=args.concurrency, api_key=args.api_key,
                         policy=RetryPolicy(attempts=args.retries + 1, max_wait=args.max_retry_wait),
                         read_timeout=args.timeout, attempt_timeout=args.job_timeout)
    todo = pending_jobs(jobs, args.output)
    stats = BatchStats(total=len(jobs), skipped=len(jobs) - len(todo), clock=time.perf_counter)
    title = f"[bold]llm-batch[/] {args.jobs.name} -> {args.output.name}  [dim]{args.url}[/]"
    try:
        outcome = _run(_runner(todo, config, stats, args.via, args.poll), stats, title, live=not args.no_progress,
                       console=display)
    except KeyboardInterrupt:
        _say(f"llm-batch: interrupted after {stats.ok + stats.failed} jobs; the results so far are in "
                  f"{args.output}, and the same command resumes")
        return EXIT_INTERRUPTED
    if args.record is not None:
        save_frame(render(stats, title), args.record)
    print(summary(stats, outcome, args.output))
    if outcome.aborted:
        _say(f"llm-batch: stopped: {outcome.aborted}")
    return EXIT_OK if stats.failed == 0 and outcome.aborted is None else EXIT_FAILED


def _runner(todo: list[Job], config: BatchConfig, stats: BatchStats, via: str,
            poll: float) -> Coroutine[Any, Any, BatchOutcome]:
    if via == "batch-api":
        return run_via_batch_api(todo, config, stats, poll=poll)
    return run_batch(todo, config, stats)


def _run(running: Coroutine[Any, Any, BatchOutcome], stats: BatchStats, title: str, *, live: bool,
         console: Console) -> BatchOutcome:
    if not live:
        return asyncio.run(running)
    with Live(get_renderable=lambda: render(stats, title), console=console, refresh_per_second=4):
        return asyncio.run(running)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summary(stats: BatchStats, outcome: BatchOutcome, output: Path) -> str:
    """One line for logs and scripts: counts, wall time, jobs per worker."""
    per_worker = ", ".join(f"{t.name} {t.done}" for t in stats.workers.values()) or "none"
    line = (f"llm-batch: {stats.total} jobs: {stats.ok} ok, {stats.failed} failed, {stats.skipped} skipped "
            f"(done before), {stats.retries} retries, {stats.tokens} tokens in {stats.elapsed:.1f} s; "
            f"jobs per worker: {per_worker}; results: {output}")
    if stats.failures:
        line += "; failures: " + ", ".join(f"{r} {n}" for r, n in stats.failures.most_common())
    return line


if __name__ == "__main__":
    sys.exit(main())
