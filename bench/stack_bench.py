"""The whole stack's own cost per token on the tiny model, beside llama.cpp's `llama-batched-bench`.

Owns: the workload (N concurrent greedy streams of exactly `--tokens` tokens through the coordinator,
end tokens banned, on bench/tiny_model.py's random-weight model), the pool it starts (a coordinator
and `--workers` workers of 1 llama.cpp thread and `--sessions` sequences each, as start.sh's), the
load-generator processes, building and running `llama-batched-bench` from the pinned llama.cpp sources
(bench/llama_server.py's cache folder and configure step, its own target), the figures it prints and
bench/results/stack_bench.json.
Must not: change the code it measures, or listen anywhere but 127.0.0.1; every process it starts is
stopped by its own pid.

Each figure is CPU time (utime + stime from /proc/<pid>/stat) of one process over the measured window,
divided by the generated tokens (the streams' own `usage`): per-process CPU, not wall time, so it stays
meaningful on a machine whose cores other work shares. Printed per run:
  worker           each worker's whole CPU per token it generated (its tokens: `worker_generation_tokens_total`)
  outside decode   that less the engine thread's CPU inside `llama_decode` (the worker's
                   `worker_decode_cpu_seconds_total`: with 1 llama.cpp thread the decode runs on the
                   engine thread), and, beside it, that less llama-batched-bench's decode time per token
                   at the worker's batch size (B = streams / workers) on the same model and thread count
  coordinator      the coordinator's CPU per relayed token
  tok/s            the stack's generated tokens over the window; against the ceiling: `--workers` x
                   what one core decodes at llama-batched-bench's CPU cost per token (its run of
                   `--tokens` less its run of 1, over the tokens between: CPU, as the rest), and by
                   CPU alone: batched-bench's decode CPU per token over the worker's whole CPU per
                   token (the share of that ceiling the workers reach with a core each, no one else
                   on it; the wall figure also pays for whatever else runs on the machine)

The load generators are `--clients` separate processes (bare asyncio HTTP/1.1 clients that read every
stream to the end and parse it afterwards), connected before a signal starts them all; the window runs
from that signal to the last stream's end.

    .venv/bin/python -m bench.stack_bench [--streams 64] [--tokens 128] [--workers 2] [--sessions 64]
                                          [--api openai|chat|infer] [--reps 1] [--no-batched-bench]
                                          [--stream-interval SECONDS]
    .venv/bin/python -m bench.stack_bench --build-only     # build llama-batched-bench (minutes) and exit
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.llama_server import BUILD_TIMEOUT, Build, configure_argv, locked
from bench.processes import code_version, pool
from bench.tiny_bench import (
    PREFILL_CHUNK,
    SESSION_TOKENS,
    _dechunk,
    add_client_child_arguments,
    client_child_ids,
    cpu_seconds,
    post_when,
    prompt_text,
    signal_and_collect,
    thread_cpu_seconds,
)
from bench.tiny_model import DEFAULT_OUT, ensure_tiny_model
from bench.worker_token import auth_headers
from protocol.sse import SseParser

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = "llama-batched-bench"
PATHS = {"openai": "/v1/completions", "chat": "/v1/chat/completions", "infer": "/coordinator/infer"}
PROMPT_TOKENS = 20  # about what prompt_text's prompts tokenize to, for batched-bench's -npp


# -- llama-batched-bench ---------------------------------------------------------------------------


def batched_bench_binary(build: Build | None = None, *, jobs: int = 2) -> Path:
    """llama-batched-bench built from the pinned sources, in llama-server's build folder (same configure)."""
    build = build or Build.default()
    binary = build.build_dir / "bin" / TARGET
    if binary.is_file():
        return binary
    from bench.llama_server import sources  # fetches and unpacks the sdist when missing
    sources(build)
    with locked(build.folder):
        if not binary.is_file():
            print(f"building {TARGET} in {build.build_dir} (minutes) ...", file=sys.stderr, flush=True)
            for argv in (configure_argv(build), ["cmake", "--build", str(build.build_dir), "--config", "Release",
                                                 "--target", TARGET, "-j", str(jobs)]):
                with (build.folder / "batched-bench-build.log").open("a") as log:
                    subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   check=True, timeout=BUILD_TIMEOUT)
    return binary


@dataclass
class Batched:
    batch: int
    tg_us_per_token: float  # CPU of the generation phase per generated token (1 thread)
    tg_tokens_per_s: float  # what one core decodes at that CPU cost: 1e6 / tg_us_per_token
    wall_us_per_token: float  # its own T_TG figure: wall time, longer when other work shares the core
    line: str


def _batched_run(binary: Path, model: Path, batch: int, tokens: int, sessions: int) -> tuple[float, str]:
    """(CPU seconds of one llama-batched-bench run, its table row for B=`batch`)."""
    argv = [str(binary), "-m", str(model), "-t", "1", "-tb", "1", "-c", str(sessions * SESSION_TOKENS),
            "-b", str(PREFILL_CHUNK + sessions), "-ub", str(PREFILL_CHUNK + sessions),
            "-npp", str(PROMPT_TOKENS), "-ntg", str(tokens), "-npl", str(batch)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == batch:
            return cpu, line.strip()
    raise RuntimeError(f"{TARGET} printed no row for B={batch}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def run_batched_bench(binary: Path, model: Path, batch: int, tokens: int, sessions: int) -> Batched:
    """llama-batched-bench's decode cost per token at batch `batch`, as CPU time: a run of `tokens`
    generated tokens per sequence less a run of 1 (the load and the prompts), over the tokens between."""
    short, _ = _batched_run(binary, model, batch, 1, sessions)
    long, line = _batched_run(binary, model, batch, tokens, sessions)
    us = (long - short) / (batch * (tokens - 1)) * 1e6
    cells = [c.strip() for c in line.strip("|").split("|")]
    return Batched(batch, us, 1e6 / us, float(cells[6]) / (batch * tokens) * 1e6, line)


# -- the load generator (its own process) ------------------------------------------------------------


def request_body(api: str, i: int, tokens: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if api == "infer":
        return {"prompt": prompt_text(i), **fields}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        return {"messages": [{"role": "user", "content": prompt_text(i)}], **fields, **stream}
    return {"prompt": prompt_text(i), **fields, **stream}


async def _one_stream(port: int, api: str, i: int, tokens: int, go: asyncio.Event) -> bytes:
    return await post_when(port, PATHS[api], json.dumps(request_body(api, i, tokens)).encode(), go)


def stream_tokens(raw: bytes, api: str) -> tuple[int, str]:
    """(completion tokens the stream's usage reports, '' or why the stream is not a whole one)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        status = head.split(b"\r\n")[0].decode(errors="replace")
        return 0, f"{status}: {body[:200]!r}"
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    parser = SseParser()
    events = parser.feed(body)
    if (tail := parser.close()) is not None:
        events.append(tail)
    for event in reversed(events):
        if api == "infer" and event.event in ("done", "error"):
            data = json.loads(event.data)
            return (data["usage"]["completion_tokens"], "") if event.event == "done" else (0, event.data)
        if api != "infer" and event.data.startswith("{") and '"usage"' in event.data:
            usage = json.loads(event.data).get("usage")
            if usage:
                return usage["completion_tokens"], ""
    return 0, "no usage in the stream"


async def _client(port: int, api: str, ids: list[int], tokens: int) -> dict[str, Any]:
    go = asyncio.Event()
    tasks = [asyncio.create_task(_one_stream(port, api, i, tokens, go)) for i in ids]
    await asyncio.sleep(0.2)  # let every connection open before the signal
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    go.set()
    raws = await asyncio.gather(*tasks)
    counted = [stream_tokens(raw, api) for raw in raws]
    errors = [why for _, why in counted if why]
    errors += [f"{n} tokens, not {tokens}" for n, why in counted if not why and n != tokens]
    return {"tokens": sum(n for n, _ in counted), "errors": errors, "cpu_s": time.process_time()}


# -- one measured run --------------------------------------------------------------------------------


@dataclass
class Run:
    streams: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    coordinator_cpu_s: float
    coordinator_us_per_token: float
    worker_cpu_s: list[float]
    worker_tokens: list[int]
    worker_us_per_token: list[float]
    worker_decode_s: list[float]  # the engine thread's CPU inside llama_decode (worker_decode_cpu_seconds)
    worker_outside_us_per_token: list[float]
    # Of that, the engine thread's part (its CPU less the decode's; the busiest thread is the engine's,
    # as llama.cpp decodes on it) and every other thread's (HTTP, SSE, heartbeats).
    engine_outside_us_per_token: list[float]
    other_threads_us_per_token: list[float]
    errors: list[str] = field(default_factory=list)


def scrape(url: str, token: str) -> dict[str, float]:
    values = {}
    text = httpx.get(f"{url}/metrics", headers=auth_headers(token), timeout=10, trust_env=False).raise_for_status().text
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("worker_decode_cpu_seconds_total", "worker_generation_tokens_total"):
            values[name] = float(value)
    return values


def start_clients(port: int, api: str, n: int, tokens: int, clients: int) -> list[subprocess.Popen[str]]:
    parts = [part for part in (list(range(n))[c::clients] for c in range(clients)) if part]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.stack_bench", "--client-child", "--port", str(port),
                               "--api", api, "--ids", ",".join(map(str, part)), "--tokens", str(tokens)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for part in parts]
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a load generator failed to start")
    return procs


def measure(stack: Any, api: str, n: int, tokens: int, clients: int) -> Run:
    port = int(stack.url.rsplit(":", 1)[1])
    procs = start_clients(port, api, n, tokens, clients)
    try:
        before = [scrape(url, stack.worker_token) for url in stack.worker_urls]
        cpu0 = [cpu_seconds(pid) for pid in (*stack.coordinator_pids, *stack.worker_pids)]
        threads0 = [thread_cpu_seconds(pid) for pid in stack.worker_pids]
        results, wall = signal_and_collect(procs)
        cpu1 = [cpu_seconds(pid) for pid in (*stack.coordinator_pids, *stack.worker_pids)]
        threads1 = [thread_cpu_seconds(pid) for pid in stack.worker_pids]
        after = [scrape(url, stack.worker_token) for url in stack.worker_urls]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    generated = sum(r["tokens"] for r in results)
    spent = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    coordinator = sum(spent[:len(stack.coordinator_pids)])
    workers = spent[len(stack.coordinator_pids):]
    made = [int(b["worker_generation_tokens_total"] - a["worker_generation_tokens_total"]) or 1
            for a, b in zip(before, after, strict=True)]
    decode = [b["worker_decode_cpu_seconds_total"] - a["worker_decode_cpu_seconds_total"]
              for a, b in zip(before, after, strict=True)]
    engine = [max((t - a.get(tid, 0.0) for tid, t in b.items()), default=0.0)
              for a, b in zip(threads0, threads1, strict=True)]
    return Run(n, generated, wall, generated / wall, coordinator, coordinator / max(generated, 1) * 1e6,
               workers, made, [c / t * 1e6 for c, t in zip(workers, made, strict=True)], decode,
               [(c - d) / t * 1e6 for c, d, t in zip(workers, decode, made, strict=True)],
               [(e - d) / t * 1e6 for e, d, t in zip(engine, decode, made, strict=True)],
               [(c - e) / t * 1e6 for c, e, t in zip(workers, engine, made, strict=True)],
               [e for r in results for e in r["errors"]][:5])


def worker_flags(model: Path, sessions: int, stream_interval: float | None = None) -> list[str]:
    interval = [] if stream_interval is None else ["--stream-interval", str(stream_interval)]
    return ["--model-path", str(model), "--threads", "1", "--max-sessions", str(sessions),
            "--session-max-tokens", str(SESSION_TOKENS), "--prefill-chunk", str(PREFILL_CHUNK), "--no-prompt-cache",
            *interval]


def report(run: Run, batched: Batched | None, workers: int) -> dict[str, Any]:
    worker_us = statistics.fmean(run.worker_us_per_token)
    row: dict[str, Any] = {"worker_us_per_token": worker_us,
                           "worker_outside_decode_us_per_token": statistics.fmean(run.worker_outside_us_per_token),
                           "coordinator_us_per_token": run.coordinator_us_per_token,
                           "tokens_per_s": run.tokens_per_s}
    if batched is not None:
        row |= {"batched_us_per_token": batched.tg_us_per_token,
                "worker_outside_batched_us_per_token": worker_us - batched.tg_us_per_token,
                "ceiling_tokens_per_s": workers * batched.tg_tokens_per_s,
                "vs_ceiling": run.tokens_per_s / (workers * batched.tg_tokens_per_s),
                "vs_ceiling_cpu": batched.tg_us_per_token / worker_us}
    return row


def print_row(row: dict[str, Any], run: Run) -> None:
    lines = [(f"n={run.streams} x {run.tokens // max(run.streams, 1)} tokens: {run.tokens} in {run.wall_s:.2f} s, "
              f"{run.tokens_per_s:.0f} tok/s{'' if not run.errors else '  ERRORS: ' + '; '.join(run.errors)}"),
             "  worker CPU        " + ", ".join(f"{u:6.1f}" for u in run.worker_us_per_token) + " us/token",
             "  outside decode    " + ", ".join(f"{u:6.1f}" for u in run.worker_outside_us_per_token)
             + " us/token (less the engine thread's CPU inside llama_decode)",
             "    engine thread   " + ", ".join(f"{u:6.1f}" for u in run.engine_outside_us_per_token)
             + " us/token outside decode; other threads " + ", ".join(f"{u:6.1f}" for u in run.other_threads_us_per_token),
             f"  coordinator CPU   {row['coordinator_us_per_token']:6.1f} us/relayed token"]
    if "batched_us_per_token" in row:
        lines += [(f"  llama-batched-bench decode {row['batched_us_per_token']:6.1f} us/token; worker less that "
                   f"{row['worker_outside_batched_us_per_token']:6.1f} us/token"),
                  (f"  vs ceiling        {row['vs_ceiling']:.2f}x of {row['ceiling_tokens_per_s']:.0f} tok/s "
                   f"(wall); {row['vs_ceiling_cpu']:.2f}x by CPU per token")]
    print("\n".join(lines), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch = max(1, args.streams // args.workers)
    batched = None
    if args.batched_bench:
        binary = batched_bench_binary()
        batched = run_batched_bench(binary, args.model, batch, args.tokens, args.sessions)
        print(f"llama-batched-bench B={batch}: {batched.line}\n  decode CPU {batched.tg_us_per_token:.1f} us/token "
              f"(wall {batched.wall_us_per_token:.1f})", file=sys.stderr, flush=True)
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="stack-bench-") as logs, \
            pool(Path(logs), workers=[worker_flags(args.model, args.sessions, args.stream_interval)] * args.workers,
                 name="stack") as stack:
        measure(stack, args.api, min(args.streams, 4), 8, 1)  # warm-up
        for _ in range(args.reps):
            measured = measure(stack, args.api, args.streams, args.tokens, args.clients)
            row = report(measured, batched, args.workers)
            print_row(row, measured)
            rows.append(row)
            runs.append(asdict(measured))
    return {"rows": rows, "runs": runs, "batched_bench": asdict(batched) if batched else None,
            "verified": all(not r["errors"] and r["tokens"] == args.streams * args.tokens for r in runs)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.stack_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=64, help="sequences per worker")
    parser.add_argument("--api", choices=sorted(PATHS), default="openai",
                        help="openai: /v1/completions (no logprobs asked, so no probabilities computed); "
                             "chat: /v1/chat/completions; infer: /coordinator/infer (asks for probabilities)")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--stream-interval", type=float, default=None,
                        help="the workers' --stream-interval (default: theirs); 0 hands every step's tokens over")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--model", type=Path, default=DEFAULT_OUT, help="written by bench.tiny_model if absent")
    parser.add_argument("--no-batched-bench", dest="batched_bench", action="store_false",
                        help="skip llama-batched-bench (no ceiling columns)")
    parser.add_argument("--build-only", action="store_true", help="build llama-batched-bench, print its path, exit")
    parser.add_argument("--out", type=Path, default=RESULTS / "stack_bench.json")
    add_client_child_arguments(parser)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.workers < 1 or args.streams > args.workers * args.sessions:
        parser.error("--streams must be 1 .. workers x sessions")
    return args


def client_child(args: argparse.Namespace) -> int:
    """A load generator's process: its streams' results as one JSON line."""
    result = asyncio.run(_client(args.port, args.api, client_child_ids(args), args.tokens))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_child:
        return client_child(args)
    if args.build_only:
        print(batched_bench_binary())
        return 0
    if args.model == DEFAULT_OUT:
        ensure_tiny_model()
    started = datetime.datetime.now(datetime.UTC)
    summary = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([".venv/bin/python -m bench.stack_bench", *(argv or sys.argv[1:])]),
              "started_utc": started.isoformat(timespec="seconds"), "code": code_version(),
              "cpus": os.cpu_count(), **summary}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"raw results: {args.out}", file=sys.stderr)
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
