"""A mixed-model soak (issue 37): one coordinator and `--workers` workers, each offering a folder of the two
models the project ships (SmolLM2-135M and Gemma 3 270M, `--model-dir`) and serving one at a time (both
at once with `--max-models 2`, below), under
clients of both models for `--minutes`. What it tells: streams cut (a 200 whose stream ended without its
`[DONE]`, or with an `error` event: must be 0), refusals by status and reason (the only ones the
settings predict are `queue_timeout`, a request that waited past `QUEUE_TIMEOUT` for its model), swaps
(the workers' `worker_model_swaps_total`) and swaps a minute, and each worker's resident memory at the
start (its first model loaded, before any request), at its peak and at the end (its first model loaded
again after the soak, asked of each worker directly: the swaps' memory given back or not). With
`--keep-alive S` the workers unload an idle model after S seconds (WORKER_KEEP_ALIVE), and the bench also
waits, after the end's load, for each worker to unload it and reports its memory then, in standby with no
model loaded (`standby_kib`), against its start. With `--max-models N` each worker keeps up to N models
loaded at once (WORKER_MAX_MODELS): with 2, both models load once and nothing is swapped (`swaps` counts
those loads as `added`); the end's memory is then with both loaded.

Owns: the folder (links to the provisioned files), the clients, the table and `--out` JSON. Must not
change either service.

    .venv/bin/python -m bench.model_soak [--minutes 10] [--workers 1] [--clients 2] [--out FILE]

Each worker runs `--threads` llama.cpp threads (1 by default, so that the coordinator and the clients
keep a core of the 2-core machine), 2 sequences of 1,024 tokens. Each client sends a streamed chat of
`--max-tokens` tokens for its model, reads it to the end, thinks 0 to `--think` seconds, and sends
again; a refused request is sent again after a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.processes import Pool, pool
from bench.scale_bench import rss_kib
from bench.swap_bench import GEMMA, SMOL, folder_worker

REQUEST_TIMEOUT = 120.0  # seconds one request may take, its wait for a load included
SWAPS = re.compile(r'^worker_model_swaps_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.MULTILINE)


@dataclass
class Tally:
    done: Counter[str] = field(default_factory=Counter)  # by model
    cut: list[str] = field(default_factory=list)  # what each cut stream ended with
    refused: Counter[str] = field(default_factory=Counter)  # "status reason"
    first_token_s: dict[str, list[float]] = field(default_factory=dict)


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, tally: Tally) -> bool:
    """One streamed chat, tallied; False when it was refused (the client pauses)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            try:
                error = json.loads(text).get("error", {})
                reason = error.get("code") or error.get("type") or "?"
            except (ValueError, AttributeError):
                reason = text[:80]
            tally.refused[f"{response.status_code} {reason}"] += 1
            return False
        ended = ""
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    ended = "[DONE]"
                    break
                if '"error"' in data:
                    ended = data[:200]
                    break
                if first is None and '"content":' in data.replace(" ", ""):
                    first = time.perf_counter() - started
    if ended != "[DONE]":
        tally.cut.append(ended or "the stream ended without [DONE]")
        return True
    tally.done[model] += 1
    if first is not None:
        tally.first_token_s.setdefault(model, []).append(first)
    return True


async def client_loop(url: str, model: str, until: float, args: argparse.Namespace, tally: Tally,
                      seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        while time.monotonic() < until:
            try:
                served = await one_request(client, url, model, args.max_tokens, tally)
            except httpx.HTTPError as exc:
                tally.cut.append(f"{type(exc).__name__}: {exc}"[:200])
                served = True
            await asyncio.sleep(rng.uniform(0, args.think) if served else 1.0)


def worker_pid(worker_url: str) -> int:
    """The pid of the worker process listening at `worker_url` (its command line names the port)."""
    port = worker_url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv and b"--port" in argv and port.encode() in argv:
            return int(proc.name)
    raise RuntimeError(f"no worker process listens at {worker_url}")


async def all_unloaded(client: httpx.AsyncClient, url: str, slots: int) -> bool:
    """No slot of the worker at `url` serves a model: each answers `standby`, or not found (empty)."""
    for base in [url, *(f"{url}/slots/{k}" for k in range(1, slots))]:
        answer = await client.get(base + "/worker/health")
        if answer.status_code != 404 and answer.json()["status"] != "standby":
            return False
    return True


def swaps(running: Pool) -> Counter[str]:
    """The workers' swaps so far, by outcome."""
    total: Counter[str] = Counter()
    for url in running.worker_urls:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {running.worker_token}"}, timeout=10).text
        for outcome, value in SWAPS.findall(text):
            total[outcome] += int(float(value))
    return total


async def soak(running: Pool, args: argparse.Namespace) -> dict[str, Any]:
    pids = [worker_pid(url) for url in running.worker_urls]
    memory: list[dict[str, int]] = [{"start_kib": rss_kib(p), "peak_kib": rss_kib(p)} for p in pids]
    tally = Tally()
    started = time.monotonic()
    until = started + args.minutes * 60
    clients = [asyncio.create_task(client_loop(running.url, model, until, args, tally, seed=i * 2 + m))
               for i in range(args.clients) for m, model in enumerate((SMOL, GEMMA))]
    while not all(c.done() for c in clients):
        for i, p in enumerate(pids):
            memory[i]["peak_kib"] = max(memory[i]["peak_kib"], rss_kib(p))
        await asyncio.sleep(1.0)
    await asyncio.gather(*clients)
    minutes = (time.monotonic() - started) / 60
    swapped = swaps(running)
    # Each worker's first model again (SmolLM2: the folder's first file), then its memory after a pause.
    headers = {"authorization": f"Bearer {running.worker_token}"}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        for url in running.worker_urls:
            await client.post(url + "/worker/models/load", json={"model": SMOL}, headers=headers)
            while (await client.post(url + "/worker/models/load", json={"model": SMOL},
                                     headers=headers)).status_code != 200:
                await asyncio.sleep(0.2)
    await asyncio.sleep(3.0)
    for i, p in enumerate(pids):
        memory[i]["end_kib"] = rss_kib(p)
    if args.keep_alive > 0:  # each worker unloads SmolLM2 once it has been idle that long
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
            for i, (url, p) in enumerate(zip(running.worker_urls, pids, strict=True)):
                deadline = time.monotonic() + args.keep_alive + 60
                while not await all_unloaded(client, url, args.max_models):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} did not unload its idle model")
                    await asyncio.sleep(0.2)
                await asyncio.sleep(3.0)
                memory[i]["standby_kib"] = rss_kib(p)
    return {"minutes": round(minutes, 2), "workers": len(pids), "clients_per_model": args.clients,
            "max_tokens": args.max_tokens, "threads": args.threads, "keep_alive_s": args.keep_alive,
            "max_models": args.max_models, "done": dict(tally.done),
            "cut": len(tally.cut), "cut_examples": tally.cut[:5], "refused": dict(tally.refused),
            "swaps": dict(swapped), "swaps_per_minute": round(sum(swapped.values()) / minutes, 2),
            "first_token_median_s": {m: round(sorted(v)[len(v) // 2], 3) for m, v in tally.first_token_s.items()},
            "first_token_max_s": {m: round(max(v), 3) for m, v in tally.first_token_s.items()},
            "memory": memory}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--clients", type=int, default=2, help="clients of each model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think", type=float, default=2.0, help="most seconds a client waits between requests")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep-alive", type=float, default=0.0,
                        help="the workers' WORKER_KEEP_ALIVE: an idle model is unloaded after it (0: never)")
    parser.add_argument("--max-models", type=int, default=1,
                        help="the workers' WORKER_MAX_MODELS: models each keeps loaded at once")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    work, worker = folder_worker("model-soak-", args.threads)
    if args.keep_alive > 0:
        worker = [*worker, "--keep-alive", str(args.keep_alive)]
    if args.max_models > 1:
        worker = [*worker, "--max-models", str(args.max_models)]
    with pool(work, workers=[worker] * args.workers) as running:
        result = asyncio.run(soak(running, args))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    unpredicted = {k: v for k, v in result["refused"].items() if not k.endswith("queue_timeout")}
    return 1 if result["cut"] or unpredicted else 0


if __name__ == "__main__":
    raise SystemExit(main())
