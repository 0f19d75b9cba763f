"""The worker's own cost per generated token, measured on a tiny model where `llama_decode` is cheap.

Owns: the workload (N concurrent greedy streams of exactly `--tokens` tokens, end tokens banned, on the
tiny random-weight model of bench/tiny_model.py), the load-generator processes, the ceiling loop, the
figures it prints and bench/results/tiny_bench.json.
Must not: change worker code or run two measured things at once. Only 127.0.0.1 is used; every process
it starts is stopped by its own pid.

For each stream count it reports:
  outside decode   the engine's step period (mean inter-token gap, from the worker's own histogram)
                   less the mean `llama_decode` time, divided by the sequences in a step: wall time per
                   generated token that is not llama.cpp. On a 2-core machine that the load generators
                   share, a descheduled engine thread counts here too, so the CPU figure below is the
                   steadier one.
  worker CPU/token the worker process's user+system CPU (/proc/<pid>/stat, every thread: engine, HTTP,
                   SSE) over the measured window, divided by the generated tokens; llama.cpp runs on 1
                   thread, so no spin-waiting is counted. `of which decode` is the decode seconds.
  per thread       the same CPU split by thread (/proc/<pid>/task): the engine thread (the busiest, as
                   llama.cpp decodes on it), its part outside decode, and every other thread (HTTP,
                   SSE); and the engine thread's waiting: its wall time outside decode less its CPU
                   outside decode, per token (the GIL held by the HTTP side, or the core taken by
                   another process). Moving the HTTP side to its own process (the vLLM split) could
                   save at most the part of that wait that is the GIL's.
  tok/s            generated tokens over the window, against the ceiling: the same model and context
                   shape in a plain in-process loop (one `llama_decode` per step with one row per
                   sequence, prompts prefilled `prefill_chunk` tokens at a time, numpy argmax over the
                   logits matrix with end tokens banned; no HTTP, no threads).

The load generators are `--clients` separate processes, each a bare asyncio HTTP/1.1 client that reads
its streams to the end and parses them only afterwards, so their cost stays out of the worker's way;
they connect first and start together on a signal, and the window is from that signal to the last
stream's end.

    .venv/bin/python -m bench.tiny_bench [--streams 16,64,256] [--tokens 128] [--clients 2] [--no-probabilities]
                                         [--sampling greedy|default] [--worker-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.processes import code_version, free_port, peer_env, serving
from bench.tiny_model import DEFAULT_OUT, ensure_tiny_model
from protocol.sse import SseParser

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SESSION_TOKENS = 256  # per session: the prompt (about 20 tokens) and up to 200 generated ones
PREFILL_CHUNK = 256  # the worker's default
TICKS = os.sysconf("SC_CLK_TCK")


def prompt_text(i: int) -> str:
    return f"Tell me a story about number {i}."


@dataclass
class Cell:
    streams: int
    tokens: int  # generated tokens, verified by each stream's done event
    verified: bool
    wall_s: float
    tokens_per_s: float
    worker_cpu_s: float
    cpu_us_per_token: float
    decode_s: float
    decode_us_per_token: float
    outside_decode_us_per_token: float  # wall: mean step period less mean decode, per sequence in a step
    mean_batch: float
    mean_step_ms: float
    mean_decode_ms: float
    client_cpu_s: float
    errors: list[str]
    # Per thread of the worker (/proc/<pid>/task): the engine thread is the busiest one, since
    # llama.cpp decodes on it with --threads 1. What a separate engine process would take off it is
    # bounded by `engine_wait_us_per_token`: the engine thread's wall time outside decode that it did
    # not spend computing (waiting for the GIL held by the HTTP side, or descheduled).
    engine_cpu_us_per_token: float = 0.0
    http_cpu_us_per_token: float = 0.0  # every other thread of the worker
    engine_wait_us_per_token: float = 0.0


@dataclass
class Ceiling:
    streams: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    decode_s: float
    steps: int


# -- the load generator (its own process) ----------------------------------------------------------------


async def _one_stream(port: int, i: int, tokens: int, go: asyncio.Event, probabilities: bool,
                      sampling: str) -> bytes:
    fields: dict[str, Any] = {"prompt": prompt_text(i), "max_tokens": tokens, "ignore_eos": True}
    if sampling == "greedy":
        fields["temperature"] = 0  # otherwise the request's defaults: temperature 0.8, top-k 40, top-p 0.95
    if not probabilities:
        fields["probabilities"] = False  # as the OpenAI surface sends when no logprobs are asked for
    return await post_when(port, "/worker/generate", json.dumps(fields).encode(), go)


async def post_when(port: int, path: str, body: bytes, go: asyncio.Event) -> bytes:
    """POSTs `body` (JSON) to `path` on a connection opened now, once `go` is set; the whole response, read
    to its end (the server closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    await go.wait()
    writer.write(head + body)
    await writer.drain()
    data = await reader.read(-1)
    writer.close()
    return data


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def check_stream(raw: bytes, tokens: int) -> str:
    """'' when the response is a 200 stream whose done event proves exactly `tokens` tokens, else why not."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        status = head.split(b"\r\n")[0].decode(errors="replace")
        return f"{status}: {body[:200]!r}"
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    parser, last_index, done = SseParser(), -1, None
    events = parser.feed(body)
    if (tail := parser.close()) is not None:
        events.append(tail)
    for event in events:
        if event.event == "token":
            last_index = json.loads(event.data)["index"]
        elif event.event == "done":
            done = json.loads(event.data)
        elif event.event == "error":
            return f"error event: {event.data}"
    if done is None:
        return "no done event"
    # The last token event may end a few tokens early: random tokens can stop mid-character, and bytes
    # of a character never finished are dropped (worker/engine/textstream.py); `done` still counts them.
    if done["usage"]["completion_tokens"] != tokens or not 0 <= last_index < tokens or done["finish_reason"] != "length":
        return f"done {done['usage']}, last index {last_index}, finish {done['finish_reason']}"
    return ""


async def _client(port: int, ids: list[int], tokens: int, probabilities: bool, sampling: str) -> dict[str, Any]:
    go = asyncio.Event()
    tasks = [asyncio.create_task(_one_stream(port, i, tokens, go, probabilities, sampling)) for i in ids]
    await asyncio.sleep(0.2)  # let every connection open before the signal
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    go.set()
    raws = await asyncio.gather(*tasks)
    cpu = time.process_time()
    return {"errors": [e for e in (check_stream(r, tokens) for r in raws) if e], "streams": len(raws),
            "cpu_s": cpu}


# -- the ceiling (its own process) -----------------------------------------------------------------------


def ceiling_child(model_path: Path, n: int, tokens: int, threads: int) -> dict[str, Any]:
    import llama_cpp as ll
    import numpy as np

    from worker.backends.llama_model import Model
    from worker.sessions.messages import Message

    model = Model(model_path)
    vocab = model.shape.n_vocab
    prompts = [model.tokenize(model.render_chat([Message("user", prompt_text(i))]), add_special=True)
               for i in range(n)]
    params = ll.llama_context_default_params()
    params.n_ctx = SESSION_TOKENS * n  # the worker's derived ctx_size for these settings
    params.n_batch = params.n_ubatch = PREFILL_CHUNK + n
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    params.swa_full = True
    params.type_k = params.type_v = model.kv_type
    params.no_perf = True
    ctx = ll.llama_init_from_model(model.handle, params)
    mem = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(params.n_batch, 0, 1)
    banned = np.array(model.eog_tokens, dtype=np.intp)
    decode_s, steps = 0.0, 0

    def decode(rows: int) -> np.ndarray:
        nonlocal decode_s, steps
        batch.n_tokens = rows
        started = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        decode_s += time.perf_counter() - started
        steps += 1
        return np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(params.n_batch, vocab))

    def put(row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
        batch.seq_id[row][0], batch.logits[row] = seq, logits

    def greedy(logits: np.ndarray) -> list[int]:
        logits[:, banned] = -np.inf
        return [int(t) for t in logits.argmax(axis=1)]

    def generate() -> float:
        started = time.perf_counter()
        last: list[int] = [0] * n
        pending = [(s, p) for s, prompt in enumerate(prompts) for p in range(len(prompt))]
        while pending:  # prompts, `PREFILL_CHUNK` tokens a step, like the worker
            chunk, pending = pending[:PREFILL_CHUNK], pending[PREFILL_CHUNK:]
            ends = [(row, s) for row, (s, p) in enumerate(chunk) if p == len(prompts[s]) - 1]
            for row, (s, p) in enumerate(chunk):
                put(row, prompts[s][p], p, s, p == len(prompts[s]) - 1)
            logits = decode(len(chunk))
            picked = greedy(logits[:len(ends)])
            for (_, s), token in zip(ends, picked, strict=True):
                last[s] = token
        for step in range(1, tokens):
            for s in range(n):
                put(s, last[s], len(prompts[s]) + step - 1, s, True)
            last = greedy(decode(n)[:n])
        elapsed = time.perf_counter() - started
        for s in range(n):
            ll.llama_memory_seq_rm(mem, s, -1, -1)
        return elapsed

    generate()  # warm-up
    decode_s, steps = 0.0, 0
    wall = generate()
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    model.close()
    return asdict(Ceiling(n, n * tokens, wall, n * tokens / wall, decode_s, steps))


def run_ceiling(model: Path, n: int, tokens: int, threads: int) -> Ceiling:
    argv = [sys.executable, "-m", "bench.tiny_bench", "--ceiling-child", "--model", str(model),
            "--streams", str(n), "--tokens", str(tokens), "--threads", str(threads)]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    return Ceiling(**json.loads(out.stdout.strip().splitlines()[-1]))


# -- the worker ------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def scrape(url: str) -> dict[str, float]:
    values = {}
    # The worker runs without a worker token (`run`), so /metrics, like generate, needs none.
    for line in httpx.get(f"{url}/metrics", timeout=10, trust_env=False).raise_for_status().text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_sum", "_count")) or name == "worker_generation_tokens_total":
            values[name] = float(value)
    return values


def run_worker_cell(url: str, port: int, pid: int, n: int, tokens: int, clients: int, probabilities: bool,
                    sampling: str) -> Cell:
    ids = [list(range(n))[c::clients] for c in range(clients)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.tiny_bench", "--client-child", "--port", str(port),
                               "--ids", ",".join(map(str, part)), "--tokens", str(tokens),
                               "--sampling", sampling, *([] if probabilities else ["--no-probabilities"])],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for part in ids if part]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a load generator failed to start")
        before, cpu0, threads0 = scrape(url), cpu_seconds(pid), thread_cpu_seconds(pid)
        results, wall = signal_and_collect(procs)
        cpu1, threads1, after = cpu_seconds(pid), thread_cpu_seconds(pid), scrape(url)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    errors = [e for r in results for e in r["errors"]]
    generated = int(delta["worker_generation_tokens_total"])
    steps = delta["worker_decode_step_seconds_count"] or 1.0
    mean_decode = delta["worker_decode_step_seconds_sum"] / steps
    mean_step = delta["worker_inter_token_latency_seconds_sum"] / (delta["worker_inter_token_latency_seconds_count"]
                                                                  or 1.0)
    mean_batch = delta["worker_batch_size_sum"] / (delta["worker_batch_size_count"] or 1.0)
    worker_cpu = cpu1 - cpu0
    per_thread = {tid: t - threads0.get(tid, 0.0) for tid, t in threads1.items()}
    engine_cpu = max(per_thread.values(), default=0.0)
    engine_outside_cpu_us = (engine_cpu - delta["worker_decode_step_seconds_sum"]) / generated * 1e6
    outside_us = (mean_step - mean_decode) / mean_batch * 1e6
    return Cell(streams=n, tokens=generated, verified=not errors and generated == n * tokens, wall_s=wall,
                tokens_per_s=generated / wall, worker_cpu_s=worker_cpu,
                cpu_us_per_token=worker_cpu / generated * 1e6,
                decode_s=delta["worker_decode_step_seconds_sum"],
                decode_us_per_token=delta["worker_decode_step_seconds_sum"] / generated * 1e6,
                outside_decode_us_per_token=outside_us,
                mean_batch=mean_batch, mean_step_ms=mean_step * 1e3, mean_decode_ms=mean_decode * 1e3,
                client_cpu_s=sum(r["cpu_s"] for r in results), errors=errors[:5],
                engine_cpu_us_per_token=engine_cpu / generated * 1e6,
                http_cpu_us_per_token=(worker_cpu - engine_cpu) / generated * 1e6,
                engine_wait_us_per_token=outside_us - engine_outside_cpu_us)


def signal_and_collect(procs: list[subprocess.Popen[str]]) -> tuple[list[dict[str, Any]], float]:
    """Starts every ready load generator at once; each one's result (its last line, JSON) and the
    seconds from the signal until the last one finished."""
    started = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1]) for proc in procs]
    return results, time.perf_counter() - started


def worker_argv(model: Path, port: int, n: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "worker", "--model-path", str(model), "--port", str(port),
            "--coordinator-url", "", "--threads", str(threads), "--max-sessions", str(n),
            "--session-max-tokens", str(SESSION_TOKENS), "--prefill-chunk", str(PREFILL_CHUNK),
            "--no-prompt-cache", "--log-level", "warning"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for n in args.streams:
        ceilings = [run_ceiling(args.model, n, args.tokens, args.threads) for _ in range(args.reps)] \
            if args.ceiling else []
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with serving("worker", worker_argv(args.model, port, n, args.threads), f"{url}/worker/health",
                     log_path=RESULTS / "tiny_worker.log", env=peer_env(None),
                     cwd=args.worker_tree or ROOT) as proc:
            run_worker_cell(url, port, proc.pid, min(n, 4), 8, 1, args.probabilities, args.sampling)  # warm-up
            cells = [run_worker_cell(url, port, proc.pid, n, args.tokens, args.clients, args.probabilities,
                                     args.sampling) for _ in range(args.reps)]
        ceiling_tps = statistics.median(c.tokens_per_s for c in ceilings) if ceilings else float("nan")

        def med(name: str, cells: list[Cell] = cells) -> float:
            return statistics.median(getattr(c, name) for c in cells)

        row = {"streams": n, "outside_decode_us_per_token": med("outside_decode_us_per_token"),
               "cpu_us_per_token": med("cpu_us_per_token"), "decode_us_per_token": med("decode_us_per_token"),
               "worker_tokens_per_s": med("tokens_per_s"), "ceiling_tokens_per_s": ceiling_tps,
               "vs_ceiling": med("tokens_per_s") / ceiling_tps, "verified": all(c.verified for c in cells),
               "engine_cpu_us_per_token": med("engine_cpu_us_per_token"),
               "http_cpu_us_per_token": med("http_cpu_us_per_token"),
               "engine_wait_us_per_token": med("engine_wait_us_per_token"),
               "cells": [asdict(c) for c in cells], "ceilings": [asdict(c) for c in ceilings]}
        rows.append(row)
        print(f"n={n:>3}  outside decode {row['outside_decode_us_per_token']:6.1f} us/tok  "
              f"worker CPU {row['cpu_us_per_token']:6.1f} us/tok (decode {row['decode_us_per_token']:6.1f})  "
              f"{row['worker_tokens_per_s']:7.0f} tok/s vs ceiling {ceiling_tps:7.0f} "
              f"({row['vs_ceiling']:.2f}x)  mean batch {med('mean_batch'):5.1f}\n"
              f"       engine thread CPU {row['engine_cpu_us_per_token']:6.1f} us/tok, of which outside decode "
              f"{row['engine_cpu_us_per_token'] - row['decode_us_per_token']:6.1f}; engine thread waiting "
              f"{row['engine_wait_us_per_token']:6.1f} us/tok; other threads (HTTP, SSE) CPU "
              f"{row['http_cpu_us_per_token']:6.1f} us/tok"
              f"{'' if row['verified'] else '  NOT VERIFIED: ' + '; '.join(cells[0].errors)}",
              file=sys.stderr, flush=True)
    return {"rows": rows}


def add_client_child_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden flags a benchmark's load-generator child is started with (its port and stream ids)."""
    parser.add_argument("--client-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ids", default="", help=argparse.SUPPRESS)


def client_child_ids(args: argparse.Namespace) -> list[int]:
    return [int(i) for i in args.ids.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.tiny_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="16,64,256", help="comma-separated concurrent stream counts")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--reps", type=int, default=1, help="repetitions per stream count (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: no spin-wait counted)")
    parser.add_argument("--model", type=Path, default=DEFAULT_OUT, help="written by bench.tiny_model if absent")
    parser.add_argument("--out", type=Path, default=RESULTS / "tiny_bench.json")
    parser.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="skip the in-process loop (it crashed with SIGSEGV on the CUDA build of "
                             "bench/gpu_check.sh, not yet understood): no ceiling column")
    parser.add_argument("--no-probabilities", dest="probabilities", action="store_false",
                        help="requests say probabilities: false (no per-token softmax), as an OpenAI client "
                             "that asks for no logprobs")
    parser.add_argument("--sampling", choices=("greedy", "default"), default="greedy",
                        help="greedy (temperature 0), or the requests' default sampling: temperature 0.8, top-k 40, "
                             "top-p 0.95 (the ceiling loop stays greedy)")
    parser.add_argument("--worker-tree", type=Path, default=None,
                        help="run the worker from this checkout (e.g. a git worktree of an older commit), to "
                             "compare two versions in one session; the load generators and ceiling stay this one's")
    add_client_child_arguments(parser)
    args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    if not args.streams or min(args.streams) < 1 or max(args.streams) > 256:
        parser.error("stream counts must be 1..256 (the worker's max_sessions bound)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_child:
        ids = client_child_ids(args)
        print(json.dumps(asyncio.run(_client(args.port, ids, args.tokens, args.probabilities, args.sampling))))
        return 0
    if args.ceiling_child:
        print(json.dumps(ceiling_child(args.model, args.streams[0], args.tokens, args.threads)))
        return 0
    if args.model == DEFAULT_OUT:
        ensure_tiny_model()
    started = datetime.datetime.now(datetime.UTC)
    summary = run(args)
    record = {"command": " ".join([".venv/bin/python -m bench.tiny_bench", *(argv or sys.argv[1:])]),
              "started_utc": started.isoformat(timespec="seconds"), "code": code_version(),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if not k.endswith("child") and k not in ("port", "ids")},
              **summary}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"raw results: {args.out}", file=sys.stderr)
    return 0 if all(r["verified"] for r in summary["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
