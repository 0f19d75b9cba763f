"""Worker throughput benchmark: our worker against llama-cpp-python's server, llama.cpp's own
llama-server and a plain batched loop.

Owns: the workload (N concurrent streams of exactly `--tokens` greedy tokens, end tokens banned), the
peers it is run against, the repetitions, the table it prints and bench/results/worker_bench.json.
Must not: change or monkey-patch worker code, or run two peers at the same time. Only 127.0.0.1 is used,
and every process it starts is stopped by its own pid in a `finally` block.

Peers, all with the same model and the same llama.cpp thread count:
  worker   `python -m worker` as a subprocess; POST /worker/generate with ignore_eos; a stream counts when
           its `done` event says 64 completion tokens, finish_reason "length", last token index 63.
  server   `python -m llama_cpp.server` (--interrupt_requests False, or a new request cuts the running
           stream; --logits_all False unless asked, its faster setting); POST /v1/completions with the
           worker's chat-rendered prompt text (the token ids are checked equal up front), repeat_penalty
           1.0 (its default 1.1 is not plain greedy), and `logit_bias` -100 on every end token since it
           has no ignore_eos; `finish_reason == "length"` proves 64 tokens.
  llama-server  llama.cpp's own server (bench/llama_server.py builds it once from the llama.cpp sources
           vendored in the pinned llama-cpp-python sdist), 16 slots of 2048 tokens like the worker's
           sessions, its RAM prompt cache off (--cache-ram 0); POST /completion with the same prompt
           text (token ids checked equal up front through its /tokenize), n_predict, ignore_eos,
           cache_prompt false (the worker runs with --no-prompt-cache); a stream counts when its last
           chunk says tokens_predicted == --tokens, stop_type "limit", tokens_evaluated == the prompt's
           length, and the token ids streamed number at most --tokens (a token whose text ends inside a
           UTF-8 character is streamed without its id). Not run unless named in --peers.
  ceiling  its own subprocess running llama.cpp's low-level API with the worker's context shape: one
           `llama_decode` for all prompts, then one per step holding one token of every sequence (seq
           ids 0..N-1 in ascending order), a logit-bias + greedy sampler chain; no HTTP, no threads. It
           decodes the workload once as a warm-up, then once measured.

The machine is shared and small, so absolute numbers move from run to run; the result is the ratio
between peers measured in the same run, cells interleaved (peer order rotates every repetition),
median over the repetitions. Before each cell the run waits for other processes to go quiet, and a
cell during which they took more than `--max-other-cores` is measured again (kept in the JSON).

    .venv/bin/python -m bench.worker_bench [--streams 1,8,16] [--tokens 64] [--reps 3] [--threads 2]
    .venv/bin/python -m bench.worker_bench --peers worker,llama-server,server

On a GPU (bench/gpu_check.sh): `--sessions 64 --streams 1,16,64 --gpu-layers 999` gives every peer 64
sequences and all layers on the device, and `--llama-server-bin` names a llama-server built there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.llama_server import Build, LlamaServer, provision
from bench.processes import code_version, free_port, peer_env, serving
from protocol.sse import SseParser

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PEERS = ("worker", "server", "ceiling", "llama-server")
DEFAULT_PEERS = ("worker", "server", "ceiling")  # llama-server needs a build first (minutes, once)
PEER_NAMES = {"worker": "worker (ours)", "server": "llama_cpp.server", "ceiling": "ceiling (in-process)",
              "llama-server": "llama-server"}
HTTP_PEERS = ("worker", "server", "llama-server")
TARGET_STREAMS = 16
TARGET_VS_SERVER = 2.5
TARGET_VS_CEILING = 0.90
# Mirrors the worker's defaults (settings.session_max_tokens x max_sessions) for the ceiling's context.
SESSION_TOKENS = 2048
MAX_SESSIONS = 16


def prompt_text(i: int) -> str:
    return f"Tell me a story about number {i}."


# -- results -----------------------------------------------------------------------------------------


@dataclass
class Stream:
    tokens: int  # generated tokens this stream is known to have produced
    verified: bool  # the peer proved exactly `--tokens` tokens (usage, finish_reason or own count)
    ttft_s: float
    text: str = ""
    events: int = 0  # SSE token events / text chunks received
    error: str = ""
    peer_ttft_s: float | None = None


@dataclass
class Cell:
    peer: str
    streams: int
    rep: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    ttft_median_ms: float
    verified: bool
    loadavg_before: float
    other_cpu_cores: float = 0.0  # CPU used by processes not ours while the cell ran, in cores
    waited_for_quiet_s: float = 0.0
    attempt: int = 1
    decode_s: float | None = None  # seconds inside llama_decode during the cell (worker: its /metrics)
    decode_steps: int | None = None
    peer_ttft_median_ms: float | None = None  # the worker's own TTFT (admission to first token, done event)
    client_cpu_s: float = 0.0  # CPU seconds of the bench's HTTP client during the cell
    peer_cpu_s: float = 0.0  # CPU seconds of the peer's process during the cell
    discarded: bool = False  # others took too much CPU during it; measured again
    errors: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    events: list[int] = field(default_factory=list)


def summarize(peer: str, n: int, rep: int, started: float, ended: float, streams: list[Stream],
              load: float, expected: int) -> Cell:
    wall = ended - started
    tokens = sum(s.tokens for s in streams)
    peer_ttfts = [s.peer_ttft_s for s in streams if s.peer_ttft_s is not None]
    verified = len(streams) == n and all(s.verified and s.tokens == expected for s in streams)
    return Cell(peer=peer, streams=n, rep=rep, wall_s=wall, tokens=tokens,
                tokens_per_s=tokens / wall if wall > 0 else 0.0,
                ttft_median_ms=statistics.median(s.ttft_s for s in streams) * 1e3 if streams else 0.0,
                verified=verified, loadavg_before=load, errors=[s.error for s in streams if s.error],
                texts=[s.text for s in streams], events=[s.events for s in streams],
                peer_ttft_median_ms=statistics.median(peer_ttfts) * 1e3 if peer_ttfts else None)


# -- HTTP peers --------------------------------------------------------------------------------------


async def sse_lines(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """Yields (event, data) pairs of a Server-Sent Events stream (the project's parser; pings skipped)."""
    parser = SseParser()
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield event.event, event.data
    if (last := parser.close()) is not None:
        yield last.event, last.data


async def worker_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int,
                        expect_prompt_tokens: int, t0: float) -> Stream:
    body = {"prompt": prompt_text(i), "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    ttft, text, events, done = -1.0, [], 0, None
    try:
        async with client.stream("POST", f"{url}/worker/generate", json=body) as response:
            if response.status_code != 200:
                return Stream(0, False, 0.0, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            prompt_tokens, last_index = -1, -1
            async for event, data in sse_lines(response):
                if event == "admitted":
                    prompt_tokens = json.loads(data)["prompt_tokens"]
                elif event == "token":
                    if ttft < 0:
                        ttft = time.perf_counter() - t0
                    item = json.loads(data)
                    text.append(item["token"])
                    last_index = item["index"]
                    events += 1
                elif event == "done":
                    done = json.loads(data)
                elif event == "error":
                    return Stream(last_index + 1, False, max(ttft, 0.0), "".join(text), events, f"error event: {data}")
    except httpx.HTTPError as exc:
        return Stream(0, False, max(ttft, 0.0), "".join(text), events, f"{type(exc).__name__}: {exc}")
    if done is None:
        return Stream(last_index + 1, False, max(ttft, 0.0), "".join(text), events, "stream ended without done")
    completion = done["usage"]["completion_tokens"]
    problems = []
    if completion != tokens:
        problems.append(f"usage.completion_tokens={completion}")
    if last_index != tokens - 1:
        problems.append(f"last token index={last_index}")
    if done["finish_reason"] != "length":
        problems.append(f"finish_reason={done['finish_reason']}")
    if prompt_tokens != expect_prompt_tokens:
        problems.append(f"prompt tokens {prompt_tokens} != {expect_prompt_tokens}")
    return Stream(completion, not problems, ttft, "".join(text), events, "; ".join(problems),
                  peer_ttft_s=done["timings"]["ttft_ms"] / 1e3)


async def server_stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
                        logit_bias: dict[str, float], t0: float) -> Stream:
    # repeat_penalty: this server defaults to 1.1, which would change the greedy text; 1.0 is plain greedy.
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "repeat_penalty": 1.0, "stream": True,
            "logit_bias": logit_bias}
    ttft, text, chunks, finish, usage = -1.0, [], 0, None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Stream(0, False, 0.0, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for _event, data in sse_lines(response):
                if data == "[DONE]":
                    break
                item = json.loads(data)
                usage = item.get("usage") or usage
                for choice in item.get("choices", []):
                    if choice.get("text"):
                        if ttft < 0:
                            ttft = time.perf_counter() - t0
                        text.append(choice["text"])
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        return Stream(0, False, max(ttft, 0.0), "".join(text), chunks, f"{type(exc).__name__}: {exc}")
    # Streamed completions carry no usage in this server; "length" is only set once `max_tokens`
    # tokens were generated (end tokens are banned, no stop strings are sent).
    count = usage["completion_tokens"] if usage else (tokens if finish == "length" else chunks)
    problems = [] if finish == "length" and count == tokens else [f"finish_reason={finish} tokens={count}"]
    return Stream(count, not problems, max(ttft, 0.0), "".join(text), chunks, "; ".join(problems))


async def llama_server_stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
                              expect_prompt_tokens: int, t0: float) -> Stream:
    # llama-server's own endpoint takes exactly what the workload needs: n_predict tokens with the end
    # tokens ignored (it bans them, as the worker does), and no reuse of an earlier identical prompt.
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "repeat_penalty": 1.0,
            "cache_prompt": False, "stream": True}
    ttft, chunks, ids = -1.0, 0, 0
    text: list[str] = []
    final: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{url}/completion", json=body) as response:
            if response.status_code != 200:
                return Stream(0, False, 0.0, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for _event, data in sse_lines(response):
                if data == "[DONE]":
                    break
                item = json.loads(data)
                if "error" in item:
                    return Stream(ids, False, max(ttft, 0.0), "".join(text), chunks, f"error: {data[:200]}")
                ids += len(item.get("tokens") or ())
                if item.get("content"):
                    if ttft < 0:
                        ttft = time.perf_counter() - t0
                    text.append(item["content"])
                    chunks += 1
                if item.get("stop"):
                    final = item
                    break
    except httpx.HTTPError as exc:
        return Stream(ids, False, max(ttft, 0.0), "".join(text), chunks, f"{type(exc).__name__}: {exc}")
    if final is None:
        return Stream(ids, False, max(ttft, 0.0), "".join(text), chunks, "stream ended without its final chunk")
    predicted = int(final.get("tokens_predicted", -1))
    problems = []
    if predicted != tokens:
        problems.append(f"tokens_predicted={predicted}")
    # Its chunks leave out the id of a token whose text ended inside a UTF-8 character (the random-weight
    # models make such tokens: 63 ids for 64 tokens), so its own count is the one checked; more ids than
    # tokens, or none, would still be wrong.
    if not 0 < ids <= tokens:
        problems.append(f"token ids streamed={ids}")
    if final.get("stop_type") != "limit":
        problems.append(f"stop_type={final.get('stop_type')}")
    if final.get("tokens_evaluated") != expect_prompt_tokens:
        problems.append(f"prompt tokens {final.get('tokens_evaluated')} != {expect_prompt_tokens}")
    return Stream(predicted, not problems, max(ttft, 0.0), "".join(text), chunks, "; ".join(problems))


async def decode_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """The worker's own count of llama_decode calls and the seconds spent in them (its /metrics; the
    worker runs without a worker token, so they need none, like its generate)."""
    values = {}
    for line in (await client.get(f"{url}/metrics")).raise_for_status().text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("worker_decode_step_seconds_count", "worker_decode_step_seconds_sum"):
            values[name] = float(value)
    return values.get("worker_decode_step_seconds_count", 0.0), values.get("worker_decode_step_seconds_sum", 0.0)


async def run_http_cell(peer: str, url: str, n: int, tokens: int, prompts: list[str], prompt_lens: list[int],
                        logit_bias: dict[str, float], rep: int) -> Cell:
    load = os.getloadavg()[0]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        counters = await decode_counters(client, url) if peer == "worker" else None
        t0 = time.perf_counter()
        if peer == "worker":
            jobs = [worker_stream(client, url, i, tokens, prompt_lens[i], t0) for i in range(n)]
        elif peer == "llama-server":
            jobs = [llama_server_stream(client, url, prompts[i], tokens, prompt_lens[i], t0) for i in range(n)]
        else:
            jobs = [server_stream(client, url, prompts[i], tokens, logit_bias, t0) for i in range(n)]
        streams = await asyncio.gather(*jobs)
        t1 = time.perf_counter()
        cell = summarize(peer, n, rep, t0, t1, list(streams), load, tokens)
        if counters is not None:
            after = await decode_counters(client, url)
            cell.decode_steps, cell.decode_s = int(after[0] - counters[0]), after[1] - counters[1]
    return cell


# -- the ceiling: a plain batched decode loop (runs in its own process) --------------------------------


def ceiling_child(n: int, tokens: int, threads: int, model_path: Path, sessions: int = MAX_SESSIONS,
                  gpu_layers: int = -1) -> dict[str, Any]:
    import llama_cpp as ll

    from worker.backends.llama_model import Model
    from worker.sessions.messages import Message

    model = Model(model_path, gpu_layers=gpu_layers)
    prompts = [model.tokenize(model.render_chat([Message("user", prompt_text(i))]), add_special=True)
               for i in range(n)]
    total = sum(len(p) for p in prompts)
    params = ll.llama_context_default_params()
    params.n_ctx = SESSION_TOKENS * sessions
    params.n_batch = params.n_ubatch = max(512, total)
    params.n_seq_max = sessions
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    params.type_k = params.type_v = model.kv_type
    params.no_perf = True
    ctx = ll.llama_init_from_model(model.handle, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create the ceiling's context")
    mem = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(params.n_batch, 0, 1)
    eog = model.eog_tokens
    samplers = []
    for _ in range(n):
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        bias = (ll.llama_logit_bias * len(eog))(*(ll.llama_logit_bias(t, float("-inf")) for t in eog))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(model.shape.n_vocab, len(eog), bias))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        samplers.append(chain)

    def put(row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
        batch.seq_id[row][0], batch.logits[row] = seq, logits

    in_decode = [0.0, 0]

    def decode(rows: int) -> None:
        batch.n_tokens = rows
        started = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        in_decode[0] += time.perf_counter() - started
        in_decode[1] += 1

    def generate() -> tuple[float, float, list[list[int]]]:
        started = time.perf_counter()
        row, last_rows = 0, []
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                put(row, token, pos, seq, pos == len(prompt) - 1)
                row += 1
            last_rows.append(row - 1)
        decode(row)
        out: list[list[int]] = [[ll.llama_sampler_sample(samplers[s], ctx, last_rows[s])] for s in range(n)]
        first = time.perf_counter()
        for step in range(1, tokens):
            for s in range(n):
                put(s, out[s][-1], len(prompts[s]) + step - 1, s, True)
            decode(n)
            for s in range(n):
                out[s].append(ll.llama_sampler_sample(samplers[s], ctx, s))
        ended = time.perf_counter()
        for s in range(n):
            ll.llama_memory_seq_rm(mem, s, -1, -1)
            ll.llama_sampler_reset(samplers[s])
        return first - started, ended - started, out

    try:
        generate()  # warm-up: page in the weights and size llama.cpp's buffers
        in_decode[:] = [0.0, 0]
        cpu_started = time.process_time()
        ttft, wall, out = generate()
        cpu = time.process_time() - cpu_started
    finally:
        for chain in samplers:
            ll.llama_sampler_free(chain)
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    texts = [b"".join(model.piece(t) for t in seq).decode("utf-8", errors="replace") for seq in out]
    return {"ttft_s": ttft, "wall_s": wall, "counts": [len(seq) for seq in out], "texts": texts,
            "banned_seen": sum(1 for seq in out for t in seq if t in eog),
            "decode_s": in_decode[0], "decode_steps": in_decode[1], "cpu_s": cpu}


def run_ceiling_cell(n: int, tokens: int, threads: int, model_path: Path, rep: int, sessions: int = MAX_SESSIONS,
                     gpu_layers: int = -1) -> Cell:
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "bench.worker_bench", "--ceiling-child", "--streams", str(n),
           "--tokens", str(tokens), "--threads", str(threads), "--model", str(model_path),
           "--sessions", str(sessions), "--gpu-layers", str(gpu_layers)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"ceiling child failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    streams = [Stream(count, count == tokens, result["ttft_s"], text, count)
               for count, text in zip(result["counts"], result["texts"], strict=True)]
    cell = summarize("ceiling", n, rep, 0.0, result["wall_s"], streams, load, tokens)
    cell.decode_s, cell.decode_steps = result["decode_s"], result["decode_steps"]
    cell.peer_cpu_s = result["cpu_s"]  # the measured loop only, not the model load and warm-up
    if result["banned_seen"]:
        cell.verified = False
        cell.errors.append(f"{result['banned_seen']} end tokens sampled")
    return cell


# -- processes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSnapshot:
    busy: int  # machine-wide busy ticks, all cores
    total: int
    client: int  # this process: the HTTP client (and the event loop driving it)
    children: int  # this process's finished children: the ceiling's subprocesses
    peers: dict[str, int]  # the peers' server processes


class CpuMeter:
    """CPU time of the whole machine against ours (this process, its children, the peers' servers).

    The machine is shared with other people's test runs; this says how much of it they took while a cell
    ran, lets the run wait for a quiet moment before each cell, and says what each side of a cell cost.
    """

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _stat(pid: str) -> list[int]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return [int(x) for x in fields[11:15]]  # utime stime cutime cstime
        return [0, 0, 0, 0]

    def snapshot(self) -> CpuSnapshot:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        total = sum(fields[:8])
        own = self._stat("self")
        return CpuSnapshot(busy=total - fields[3] - fields[4], total=total, client=own[0] + own[1],
                           children=own[2] + own[3],
                           peers={name: sum(self._stat(str(pid))[:2]) for name, pid in self.pids.items()})

    @staticmethod
    def other_cores(a: CpuSnapshot, b: CpuSnapshot) -> float:
        ours = (b.client - a.client) + (b.children - a.children) + sum(b.peers[k] - a.peers[k] for k in a.peers)
        busy, total = b.busy - a.busy, b.total - a.total
        return max(0.0, (busy - ours) / total * (os.cpu_count() or 1)) if total > 0 else 0.0

    def seconds(self, a: CpuSnapshot, b: CpuSnapshot, peer: str) -> tuple[float, float]:
        """CPU seconds of the client and of a peer's server process between two snapshots."""
        used = b.peers.get(peer, 0) - a.peers.get(peer, 0)
        return (b.client - a.client) / self.tick, used / self.tick

    async def wait_quiet(self, limit_cores: float, max_wait: float) -> float:
        """Waits until others use at most `limit_cores` over half a second; returns the seconds waited."""
        started = time.monotonic()
        while True:
            a = self.snapshot()
            await asyncio.sleep(0.5)
            if self.other_cores(a, self.snapshot()) <= limit_cores or time.monotonic() - started > max_wait:
                return time.monotonic() - started


# -- the run -----------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import llama_cpp

    gpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30).stdout.strip()
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__, "platform": platform.platform(), "gpu": gpu or "none"}


def median_of(cells: list[Cell], key: str) -> float:
    return statistics.median(getattr(c, key) for c in cells) if cells else float("nan")


def report(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    """Prints one table per stream count; returns the summary that goes into the JSON file."""
    summary: dict[str, Any] = {"discarded_noisy_cells": sum(c.discarded for c in cells)}
    cells = [c for c in cells if not c.discarded]
    print(f"\nWorker throughput: {args.tokens} tokens per stream (greedy, end tokens banned), "
          f"threads={args.threads} for every peer, median of {args.reps} reps (per column)")
    for n in args.streams:
        rows = {p: [c for c in cells if c.peer == p and c.streams == n] for p in args.peers}
        med = {p: median_of(rows[p], "tokens_per_s") for p in args.peers if rows[p]}
        print(f"\n{n} concurrent stream{'s' if n > 1 else ''}")
        print(f"  {'peer':<22}{'tok/s':>8}{'min-max':>14}{'TTFT ms':>9}{'peer CPU s':>12}{'client CPU s':>14}"
              f"{'others, cores':>15}  all streams ok")
        for p in args.peers:
            if not rows[p]:
                continue
            tps = [c.tokens_per_s for c in rows[p]]
            ok = all(c.verified for c in rows[p])
            print(f"  {PEER_NAMES[p]:<22}{med[p]:>8.1f}{f'{min(tps):.1f}-{max(tps):.1f}':>14}"
                  f"{median_of(rows[p], 'ttft_median_ms'):>9.1f}{median_of(rows[p], 'peer_cpu_s'):>12.2f}"
                  f"{median_of(rows[p], 'client_cpu_s'):>14.2f}{median_of(rows[p], 'other_cpu_cores'):>15.2f}"
                  f"  {'yes' if ok else 'NO'}")
        for p in ("worker", "ceiling"):
            timed = [c for c in rows.get(p, []) if c.decode_s is not None and c.decode_steps]
            if timed:
                share = statistics.median(c.decode_s / c.wall_s for c in timed)  # type: ignore[operator]
                per_step = statistics.median(c.decode_s / c.decode_steps * 1e3 for c in timed)  # type: ignore[operator]
                steps = statistics.median(c.decode_steps for c in timed)  # type: ignore[type-var]
                print(f"  {PEER_NAMES[p]:<22} in llama_decode {share:.0%} of wall time, "
                      f"{steps:.0f} calls, {per_step:.1f} ms per call")
        own = [c.peer_ttft_median_ms for c in rows.get("worker", []) if c.peer_ttft_median_ms is not None]
        if own:
            print(f"  {PEER_NAMES['worker']:<22} TTFT by its own clock (admitted to first token) "
                  f"{statistics.median(own):.1f} ms")
        entry: dict[str, Any] = {"tokens_per_s": med,
                                 "ttft_ms": {p: median_of(rows[p], "ttft_median_ms") for p in args.peers if rows[p]},
                                 "verified": {p: all(c.verified for c in rows[p]) for p in args.peers if rows[p]}}
        targets: tuple[tuple[str, float | None], ...] = (
            ("server", TARGET_VS_SERVER), ("ceiling", TARGET_VS_CEILING), ("llama-server", None))
        for other, target in targets:
            if "worker" not in med or other not in med:
                continue
            ratio = med["worker"] / med[other]
            paired = [w.tokens_per_s / o.tokens_per_s for w in rows["worker"] for o in rows[other] if w.rep == o.rep]
            line = (f"  worker / {PEER_NAMES[other]:<20} = {ratio:6.2f}x ({ratio:.0%})   "
                    f"per-rep {min(paired):.2f}-{max(paired):.2f}")
            if n == TARGET_STREAMS and target is not None:
                met = ratio >= target
                line += f"   target >= {target:g}x: {'MET' if met else 'MISSED'}"
                entry[f"target_vs_{other}"] = {"target": target, "met": met}
            print(line)
            entry[f"worker_over_{other}"] = ratio
            entry[f"worker_over_{other}_per_rep"] = paired
        summary[str(n)] = entry
    agreement = text_agreement(cells, args)
    if agreement:
        print("\nidentical greedy outputs, worker vs other peer (streams): "
              + ", ".join(f"{k}: {v}" for k, v in agreement.items()))
    summary["text_agreement"] = agreement
    if summary["discarded_noisy_cells"]:
        print(f"{summary['discarded_noisy_cells']} cell measurements were discarded and repeated because other "
              f"processes used more than {args.max_other_cores} cores meanwhile (kept in the JSON)")
    problems = [f"{c.peer} n={c.streams} rep={c.rep}: {e}" for c in cells for e in c.errors]
    if problems:
        print("\nproblems:\n  " + "\n  ".join(problems[:20]))
    return summary


def text_agreement(cells: list[Cell], args: argparse.Namespace) -> dict[str, str]:
    """How often the worker's greedy text equals the other peers' (a check that all did the same work)."""
    out = {}
    for other in ("server", "ceiling", "llama-server"):
        same = total = 0
        for w in (c for c in cells if c.peer == "worker"):
            for o in (c for c in cells if c.peer == other and c.streams == w.streams and c.rep == w.rep):
                for a, b in zip(w.texts, o.texts, strict=False):
                    same += a == b
                    total += 1
        if total:
            out[other] = f"{same}/{total}"
    return out


async def run_all(args: argparse.Namespace) -> list[Cell]:
    from worker.backends.llama_model import Model
    from worker.sessions.messages import Message

    model = Model(args.model, gpu_layers=0)  # the bench's own copy: chat template, tokenizer, end tokens
    try:
        rendered = [model.render_chat([Message("user", prompt_text(i))]) for i in range(max(*args.streams, 2))]
        prompt_tokens = [model.tokenize(p, add_special=True) for p in rendered]
        prompt_lens = [len(t) for t in prompt_tokens]
        logit_bias = {str(t): -100.0 for t in model.eog_tokens}
    finally:
        model.close()
    print(f"end-of-generation tokens {list(logit_bias)}; prompt tokens {min(prompt_lens)}-{max(prompt_lens)}",
          file=sys.stderr)
    RESULTS.mkdir(parents=True, exist_ok=True)
    worker_port, server_port = free_port(), free_port()
    worker_url, server_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{server_port}"
    py = sys.executable
    worker_cmd = [py, "-m", "worker", "--model-path", str(args.model), "--port", str(worker_port),
                  "--coordinator-url", "", "--threads", str(args.threads), "--max-sessions", str(args.sessions),
                  "--gpu-layers", str(args.gpu_layers),
                  # Repetitions send the same prompts: the prompt cache would skip prefill the other peers
                  # do, so it is off here to measure batched decoding alone.
                  "--no-prompt-cache",
                  "--log-level", "warning"]
    server_cmd = [py, "-m", "llama_cpp.server", "--model", str(args.model), "--n_threads", str(args.threads),
                  "--n_threads_batch", str(args.threads), "--n_ctx", "2048", "--host", "127.0.0.1",
                  "--port", str(server_port), "--interrupt_requests", "False",
                  "--logits_all", str(args.server_logits_all), "--verbose", "False"]
    urls = {"worker": worker_url, "server": server_url}
    cells: list[Cell] = []
    meter = CpuMeter()
    with contextlib.ExitStack() as stack:
        if "worker" in args.peers:
            pid = stack.enter_context(serving("worker", worker_cmd, f"{worker_url}/worker/health",
                                              log_path=RESULTS / "worker.log", env=peer_env(None))).pid
            meter.pids["worker"] = pid
            print(f"worker pid {pid} (py-spy record --pid {pid})", file=sys.stderr)
        if "server" in args.peers:
            pid = stack.enter_context(serving("llama_cpp.server", server_cmd, f"{server_url}/v1/models",
                                              log_path=RESULTS / "llama_server.log")).pid
            meter.pids["server"] = pid
            # Both peers must see the same prompt tokens; the server tokenizes the rendered text itself.
            async with httpx.AsyncClient(timeout=30) as client:
                for i, text in enumerate(rendered):
                    got = (await client.post(f"{server_url}/extras/tokenize", json={"input": text})).json()["tokens"]
                    if got != prompt_tokens[i]:
                        raise RuntimeError(f"prompt {i}: the server tokenizes it as {got}, the worker as "
                                           f"{prompt_tokens[i]}")
        if "llama-server" in args.peers:
            # Built once, minutes; else at once.
            binary = args.llama_server_bin or provision(Build.default(cache=args.llama_server_cache))
            # The worker's shape: --sessions sequences of SESSION_TOKENS each; prompt reuse off on both.
            llama_server = stack.enter_context(LlamaServer(
                args.model, threads=args.threads, n_ctx=SESSION_TOKENS, slots=args.sessions, binary=binary,
                extra_args=llama_server_args(args), log_path=RESULTS / "llama-server-binary.log"))
            assert llama_server.pid is not None
            meter.pids["llama-server"] = llama_server.pid
            urls["llama-server"] = llama_server.url
            print(f"llama-server pid {llama_server.pid} ({binary})", file=sys.stderr)
            async with httpx.AsyncClient(timeout=30) as client:
                for i, text in enumerate(rendered):
                    got = (await client.post(f"{llama_server.url}/tokenize",
                                             json={"content": text, "add_special": True})).json()["tokens"]
                    if got != prompt_tokens[i]:
                        raise RuntimeError(f"prompt {i}: llama-server tokenizes it as {got}, the worker as "
                                           f"{prompt_tokens[i]}")
        for name in args.peers:  # warm-up, not recorded
            if name in HTTP_PEERS:
                await run_http_cell(name, urls[name], 2, 8, rendered, prompt_lens, logit_bias, -1)
        for rep in range(args.reps):
            for n in args.streams:
                order = args.peers[rep % len(args.peers):] + args.peers[:rep % len(args.peers)]
                for peer in order:
                    for attempt in range(1, args.attempts + 1):
                        await asyncio.sleep(args.settle)  # let the previous peer's OpenMP threads go idle
                        waited = await meter.wait_quiet(args.quiet_cores, args.quiet_wait)
                        before = meter.snapshot()
                        if peer == "ceiling":
                            cell = await asyncio.to_thread(run_ceiling_cell, n, args.tokens, args.threads,
                                                           args.model, rep, args.sessions, args.gpu_layers)
                        else:
                            cell = await run_http_cell(peer, urls[peer], n, args.tokens, rendered, prompt_lens,
                                                       logit_bias, rep)
                        after = meter.snapshot()
                        cell.other_cpu_cores = meter.other_cores(before, after)
                        cell.client_cpu_s, peer_cpu = meter.seconds(before, after, peer)
                        if peer != "ceiling":
                            cell.peer_cpu_s = peer_cpu
                        cell.waited_for_quiet_s, cell.attempt = waited, attempt
                        # Two llama.cpp threads on two cores collapse when a third party takes a core
                        # (OpenMP barriers wait for a descheduled thread): such a cell measures the
                        # neighbours, not the peer, so it is kept in the JSON but measured again.
                        cell.discarded = cell.other_cpu_cores > args.max_other_cores and attempt < args.attempts
                        cells.append(cell)
                        print(f"rep {rep} n={n:>2} {PEER_NAMES[peer]:<22} {cell.tokens_per_s:8.1f} tok/s  "
                              f"ttft {cell.ttft_median_ms:8.1f} ms  others {cell.other_cpu_cores:.2f} cores"
                              f" (waited {waited:.1f} s){'  DISCARDED, noisy' if cell.discarded else ''}"
                              f"{'' if cell.verified else '  NOT VERIFIED: ' + '; '.join(cell.errors[:3])}",
                              file=sys.stderr, flush=True)
                        if not cell.discarded:
                            break
    return cells


def llama_server_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Its RAM prompt cache off; its layers on the GPU as the worker's are (-1: its own default)."""
    return ("--cache-ram", "0", *(("-ngl", str(args.gpu_layers)) if args.gpu_layers >= 0 else ()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from worker.provision import DEFAULT_MODEL_PATH

    parser = argparse.ArgumentParser(prog="python -m bench.worker_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,16", help="comma-separated concurrent stream counts")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every cell (median is reported)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="llama.cpp threads for every peer (default: all cores)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"subset of {','.join(PEERS)} (default {','.join(DEFAULT_PEERS)}; llama-server is "
                             "built on first use: python -m bench.llama_server --build)")
    parser.add_argument("--llama-server-cache", type=Path,
                        help="llama-server's build cache root (default $LLAMA_SERVER_CACHE, "
                             "else ~/.cache/llm-pool/llama-server)")
    parser.add_argument("--llama-server-bin", type=Path,
                        help="a llama-server built elsewhere (bench/gpu_check.sh's CUDA build) instead of the cache's")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--sessions", type=int, default=MAX_SESSIONS,
                        help=f"sequences every peer holds at once (default {MAX_SESSIONS}); the most streams")
    parser.add_argument("--gpu-layers", type=int, default=-1,
                        help="layers on the GPU for every peer (-1: each peer's default; the worker's is all when "
                             "llama.cpp was built for a GPU)")
    parser.add_argument("--server-logits-all", choices=("True", "False"), default="False",
                        help="llama_cpp.server --logits_all (its default is True, which is slower)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of idle between cells")
    parser.add_argument("--quiet-cores", type=float, default=0.3,
                        help="before each cell, wait until other processes use at most this many cores")
    parser.add_argument("--quiet-wait", type=float, default=30.0, help="longest wait for quiet, seconds")
    parser.add_argument("--max-other-cores", type=float, default=0.25,
                        help="a cell during which other processes used more CPU than this is measured again")
    parser.add_argument("--attempts", type=int, default=6, help="most measurements of one cell")
    parser.add_argument("--out", type=Path, default=RESULTS / "worker_bench.json")
    parser.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(args.peers) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}")
    if args.sessions < 1:
        parser.error("--sessions must be at least 1")
    if not args.streams or min(args.streams) < 1 or max(args.streams) > args.sessions:
        parser.error(f"stream counts must be 1..{args.sessions} (--sessions)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ceiling_child:
        print(json.dumps(ceiling_child(args.streams[0], args.tokens, args.threads, args.model, args.sessions,
                                       args.gpu_layers)))
        return 0
    started = datetime.datetime.now(datetime.UTC)
    code = code_version()
    print(f"code: commit {code['commit'][:12]}, uncommitted changes: {code['uncommitted'] or 'none'}",
          file=sys.stderr)
    cells = asyncio.run(run_all(args))
    summary = report(args, cells)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {"streams": args.streams, "tokens": args.tokens, "reps": args.reps,
                                "threads": args.threads, "peers": args.peers,
                                "server_logits_all": args.server_logits_all, "model": str(args.model),
                                "sessions": args.sessions, "gpu_layers": args.gpu_layers}
    if "llama-server" in args.peers:
        settings["llama_server"] = {"slots": args.sessions, "ctx_per_slot": SESSION_TOKENS,
                                    "extra_args": list(llama_server_args(args)),
                                    "binary": str(args.llama_server_bin or "the cache's build"),
                                    "llama_cpp_python_sdist": Build.default(cache=args.llama_server_cache).version}
    record = {"command": " ".join([".venv/bin/python -m bench.worker_bench", *(argv or sys.argv[1:])]),
              "started_utc": started.isoformat(timespec="seconds"), "machine": machine(), "code": code,
              "settings": settings, "summary": summary, "cells": [asdict(c) for c in cells]}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nraw results: {args.out}")
    ok = all(c.verified for c in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
