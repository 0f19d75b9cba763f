"""Do KV moves stall the decode loop? The inter-token gaps of running streams with and without a
session's KV being exported and imported on the same worker (issue 19: within 20%).

Owns: the workload (one real worker, ./start.sh's 1 llama.cpp thread; `--streams` greedy streams of
`--tokens` tokens each, end tokens banned; a kept session of about `--history` tokens), the two
phases (quiet, then the session exported and imported again under another id, back to back, for as
long as the streams run), the table it prints and bench/results/transfer_stall.json.
Must not: change the worker's settings. Only 127.0.0.1 is used; the worker it starts is stopped by itself.

The gaps are timed by the client, between consecutive token events of each stream, from its second
token on (the first waits for the prefill). Phases alternate, `--rounds` times each, so drift on a
shared machine hits both.

    .venv/bin/python -m bench.transfer_stall [--streams 8] [--tokens 120] [--history 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.processes import ROOT, free_port, peer_env, serving

RESULTS = ROOT / "bench" / "results"
TOKEN = "bench-token"


async def stream_gaps(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> list[float]:
    times: list[float] = []
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", url + "/worker/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith('data: {"token"'):
                times.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(times[1:])]


def mover(url: str, stop: threading.Event, moved: list[tuple[float, int]]) -> None:
    """Export the kept session `held`, import it as `copy`, end `copy`; again until `stop`."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=60, headers=headers) as client:
        while not stop.is_set():
            started = time.monotonic()
            blob = client.get(url + "/worker/sessions/held/kv").content
            assert client.put(url + "/worker/sessions/copy/kv", content=blob).status_code == 201
            assert client.delete(url + "/worker/sessions/copy").status_code == 204
            moved.append((time.monotonic() - started, len(blob)))


async def phase(url: str, streams: int, tokens: int, moving: bool) -> dict[str, Any]:
    stop, moved = threading.Event(), list[tuple[float, int]]()
    thread = threading.Thread(target=mover, args=(url, stop, moved), daemon=True) if moving else None
    async with httpx.AsyncClient(timeout=300, headers={"authorization": f"Bearer {TOKEN}"}) as client:
        if thread is not None:
            thread.start()
        gaps = await asyncio.gather(*(stream_gaps(client, url, i, tokens) for i in range(streams)))
        stop.set()
    if thread is not None:
        thread.join(timeout=60)
    flat = sorted(g for per in gaps for g in per)
    return {"moving": moving, "gaps": len(flat), "mean_ms": statistics.fmean(flat) * 1e3,
            "p50_ms": flat[len(flat) // 2] * 1e3, "p99_ms": flat[int(len(flat) * 0.99)] * 1e3,
            "moves": len(moved), "move_ms": statistics.fmean(m for m, _ in moved) * 1e3 if moved else 0.0,
            "blob_bytes": moved[0][1] if moved else 0}


def run(streams: int, tokens: int, history: int, rounds: int, log_dir: Path) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", "bench", "--threads", "1",
            "--coordinator-url", "", "--log-level", "warning"]
    with serving("worker", argv, url + "/worker/health", log_path=log_dir / "worker.log", env=peer_env(TOKEN)):
        headers = {"authorization": f"Bearer {TOKEN}"}
        words = " ".join(f"word{k % 50}" for k in range(history // 2))
        kept = httpx.post(url + "/worker/generate", headers=headers, timeout=300, json={
            "prompt": words, "session_id": "held", "max_tokens": 4, "temperature": 0})
        assert kept.status_code == 200, kept.text
        results = []
        for _ in range(rounds):
            for moving in (False, True):
                results.append(asyncio.run(phase(url, streams, tokens, moving)))
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--history", type=int, default=1000, help="tokens of the moved session, about")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        results = run(args.streams, args.tokens, args.history, args.rounds, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (RESULTS / "transfer_stall.json").write_text(json.dumps({"when": when, "args": vars(args), "phases": results},
                                                           indent=1))
    print(f"{'phase':<10} {'gaps':>6} {'mean':>9} {'p50':>9} {'p99':>9} {'moves':>6} {'move':>9} {'blob':>9}")
    for r in results:
        print(f"{'moving' if r['moving'] else 'quiet':<10} {r['gaps']:>6} {r['mean_ms']:>6.1f} ms {r['p50_ms']:>6.1f} ms "
              f"{r['p99_ms']:>6.1f} ms {r['moves']:>6} {r['move_ms']:>6.1f} ms {r['blob_bytes'] / 2**20:>6.1f} MiB")
    quiet = statistics.fmean(r["mean_ms"] for r in results if not r["moving"])
    moving = statistics.fmean(r["mean_ms"] for r in results if r["moving"])
    print(f"mean gap while moving / quiet: {moving / quiet:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
