"""A stream outlives its worker: what a client of a continued stream sees, beside fault-free runs (issue 50).

Owns: three pools it starts in turn (a coordinator and two workers of `--threads` llama.cpp threads and
`--sessions` sequences each, the default model, on 127.0.0.1), the workload (`--streams` greedy streams of
exactly `--tokens` tokens through `/coordinator/infer`, different prompts, `ignore_eos`), the faults, and
the table it prints. Must not: change product code; every process it starts is stopped however it ends.

- `fault-free`: the streams twice on a fresh pool. Printed: how many of the second run's texts equal
  the first's (greedy decoding under llama.cpp rounds by the batch's shape, so they may part).
- `SIGKILL`: the streams on a fresh pool; once each has `--kill-at` tokens, worker w1 is SIGKILLed.
  Printed: streams whole (as long as asked, token indices 0..n-1 each once), continued, equal to the
  fault-free run's first texts, and for the continued ones where their text parts from it (characters
  after the seam, the text the client had at the kill) and the pause (the longest gap between two of
  its tokens).
- `SIGTERM`: `--drain-tokens` tokens each on a fresh pool; at `--drain-at` tokens, w1 is drained.
  Printed: streams whole, moved, how many of them w2 took the cells of from w1 (a peer prefix fetch,
  when the prompt and the tokens so far reach WORKER_PEER_PREFIX_MIN_TOKENS) instead of prefilling
  them, the longest pause of a moved stream, and the seconds from the signal to w1's exit.

    .venv/bin/python -m bench.continuation_bench [--streams 8] [--tokens 160] [--kill-at 40] [--drain-tokens 400]
                                                 [--drain-at 150]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.processes import Pool, code_version, pool

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "modelFiles" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ("a fox who learns to swim", "a cat who learns to sing", "an owl who learns to cook",
          "a bear who learns to paint", "a frog who learns to dance", "a mole who learns to fly",
          "a goat who learns to read", "a crab who learns to climb")


@dataclass
class Stream:
    text: str = ""
    indices: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str = ""
    completion: int = -1
    worker: str = ""
    seam: int | None = None  # characters the client had when the fault came

    def whole(self, tokens: int) -> bool:
        """As long as asked, and no token twice or missing (an event's index is its last token's)."""
        return (self.finish == "length" and self.completion == tokens and bool(self.indices)
                and self.indices == sorted(set(self.indices)) and self.indices[-1] == tokens - 1)


async def stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, into: Stream) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
        into.worker = response.headers.get("x-worker-id", "")
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if name == "token":
                    into.text += data["token"]
                    into.indices.append(data["index"])
                    into.times.append(time.monotonic())
                elif name == "done":
                    into.finish, into.completion = data["finish_reason"], data["usage"]["completion_tokens"]
                elif name == "error":
                    into.finish = "error:" + data["reason"]


async def run(url: str, count: int, tokens: int, fault: Callable[[list[Stream]], Awaitable[None]] | None = None
              ) -> list[Stream]:
    streams = [Stream() for _ in range(count)]
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(stream(client, url, f"Write a long story about {TOPICS[i % len(TOPICS)]}.",
                                            tokens, s)) for i, s in enumerate(streams)]
        if fault is not None:
            await fault(streams)
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
    return streams


async def each_has(streams: list[Stream], tokens: int) -> None:
    deadline = time.monotonic() + 300
    while any(len(s.indices) < tokens for s in streams):
        if time.monotonic() > deadline:
            raise RuntimeError("the streams did not reach the fault's token in 300 s")
        await asyncio.sleep(0.01)


def parts(text: str, other: str) -> int | None:
    """Where `text` parts from `other` (a character index), None when equal."""
    for i, (a, b) in enumerate(zip(text, other, strict=False)):
        if a != b:
            return i
    return None if len(text) == len(other) else min(len(text), len(other))


def metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def worker_flags(args: argparse.Namespace) -> list[list[str]]:
    return [["--model-path", str(args.model), "--threads", str(args.threads), "--max-sessions", str(args.sessions),
             "--session-max-tokens", str(args.session_tokens)] for _ in range(2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--drain-tokens", type=int, default=400)
    parser.add_argument("--drain-at", type=int, default=150, help="tokens each stream has when w1 is drained")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per worker")
    parser.add_argument("--sessions", type=int, default=8, help="sequences per worker (room for the other's)")
    parser.add_argument("--session-tokens", type=int, default=512)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--only-drain", action="store_true", help="the SIGTERM scenario alone")
    args = parser.parse_args()
    print(json.dumps({"version": code_version(), "cpus": os.cpu_count(), **{k: str(v) for k, v in vars(args).items()}}))
    with tempfile.TemporaryDirectory(prefix="continuation-bench-") as logs:
        if args.only_drain:
            drain_report(args, Path(logs))
            return 0
        with pool(Path(logs), workers=worker_flags(args), name="fault-free") as clean:
            first = asyncio.run(run(clean.url, args.streams, args.tokens))
            second = asyncio.run(run(clean.url, args.streams, args.tokens))
        same = sum(parts(a.text, b.text) is None for a, b in zip(second, first, strict=True))
        print(f"fault-free: {sum(s.whole(args.tokens) for s in first)}/{args.streams} whole; the second run's "
              f"text equal to the first's: {same}/{args.streams}")
        kill_report(args, Path(logs), first)
        drain_report(args, Path(logs))
    return 0


def kill_report(args: argparse.Namespace, logs: Path, reference: list[Stream]) -> None:
    with pool(logs, workers=worker_flags(args), name="sigkill") as killed:
        at: list[float] = []

        async def kill(streams: list[Stream]) -> None:
            await each_has(streams, args.kill_at)
            for s in streams:
                s.seam = len(s.text)
            at.append(time.monotonic())
            os.kill(_pid(killed, "w1"), signal.SIGKILL)

        streams = asyncio.run(run(killed.url, args.streams, args.tokens, kill))
        continued = metric(killed.url, 'coordinator_stream_breaks_total{outcome="continued"}')
    on_killed = [s for s in streams if s.worker == "w1"]
    pauses = [max(b - a for a, b in itertools.pairwise(s.times) if b > at[0]) for s in on_killed]
    equal = sum(parts(s.text, r.text) is None for s, r in zip(streams, reference, strict=True))
    print(f"SIGKILL at token {args.kill_at}: {sum(s.whole(args.tokens) for s in streams)}/{args.streams} whole, "
          f"{len(on_killed)} on the killed worker, {continued:g} continued; text equal to the fault-free run's: "
          f"{equal}/{args.streams}; pause p50 {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s")
    for s, r in zip(streams, reference, strict=True):
        if s.worker == "w1":
            where = parts(s.text, r.text)
            print(f"  continued stream: seam at character {s.seam}, parts from the fault-free text at "
                  f"{'never' if where is None else where} ({s.finish}, {s.completion} tokens)")


def drain_report(args: argparse.Namespace, logs: Path) -> None:
    with pool(logs, workers=worker_flags(args), name="sigterm") as drained:
        took: list[float] = []
        at: list[float] = []

        async def drain(streams: list[Stream]) -> None:
            await each_has(streams, args.drain_at)
            pid = _pid(drained, "w1")
            started = time.monotonic()
            at.append(started)
            os.kill(pid, signal.SIGTERM)
            while _alive(pid) and time.monotonic() - started < 60:
                await asyncio.sleep(0.02)
            took.append(time.monotonic() - started)

        streams = asyncio.run(run(drained.url, args.streams, args.drain_tokens, drain))
        moved = metric(drained.url, 'coordinator_stream_moves_total{outcome="moved"}')
        answer = httpx.get(drained.worker_urls[1] + "/metrics", timeout=5,
                           headers={"authorization": f"Bearer {drained.worker_token}"}).text
        fetches = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in answer.splitlines()
                   if line.startswith('worker_kv_transfers_total{direction="peer_prefix"')}
        fetched = fetches.get("ok", 0.0)
    pauses = [max(b - a for a, b in itertools.pairwise(s.times) if b > at[0]) for s in streams if s.worker == "w1"]
    print(f"SIGTERM at token {args.drain_at} of {args.drain_tokens}: {sum(s.whole(args.drain_tokens) for s in streams)}"
          f"/{args.streams} whole, {moved:g} moved, {fetched:g} with their cells fetched from w1 (asked: {fetches}); longest pause "
          f"{max(pauses):.2f} s; w1 exited {took[0]:.2f} s after the signal")


def _pid(running: Pool, worker_id: str) -> int:
    return running.worker_pids[int(worker_id[1:]) - 1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
