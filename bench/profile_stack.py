"""Where a token's CPU goes, through the whole stack: py-spy samples the coordinator and the worker while
streams run on the tiny model (bench/tiny_model.py, so `llama_decode` is nearly free), and the samples
are turned into microseconds of CPU per generated token, by thread and by function.

Owns: the pool it starts (one coordinator, one worker on the tiny model, `--threads` llama.cpp threads),
the load (`--streams` concurrent `/coordinator/infer` streams of `--tokens` tokens, greedy, end tokens
banned, started again as each ends, for `--seconds`), the two py-spy recordings and the table.
Must not: change coordinator or worker code. Only 127.0.0.1 is used; everything started is stopped.

    .venv/bin/python -m bench.profile_stack [--streams 64] [--tokens 128] [--seconds 15] [--top 12]

How the figures are made: each process's CPU time comes from /proc over the window (all its threads),
over the tokens generated. py-spy (`--nonblocking`, without `--idle`, so a
sample is taken only where a thread is running) gives each function's share of its process's samples
("self": the innermost frame; without `--native`, time in C is the Python line that called it, so
`Engine._step`'s line 262 is `llama_decode`), and a function's or a thread role's figure is that share
of the process's CPU per token.
The load generator runs in this process and shares the cores: its cost is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.processes import pool
from bench.tiny_model import ensure_tiny_model

TICK = os.sysconf("SC_CLK_TCK")


def pid_listening_on(port: int) -> int:
    """The pid of the python process started with `--port <port>`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                    return int(entry.name)
    raise RuntimeError(f"no process with --port {port}")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed; Python's threads all show as `python`)."""
    found: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            found[name] += (int(fields[11]) + int(fields[12])) / TICK
    return dict(found)


async def load(url: str, streams: int, tokens: int, seconds: float) -> int:
    """Streams kept `streams` at once until `seconds` pass; the tokens generated (from `done` events)."""
    body = {"prompt": "Tell me a story.", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    deadline, generated = time.monotonic() + seconds, 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal generated
        while time.monotonic() < deadline:
            async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"finished":true' in line:
                        generated += json.loads(line[6:]).get("usage", {}).get("completion_tokens", 0)

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))
    return generated


ROLES = (("engine thread (llama_decode and sampling)", "Engine._run"),
         ("thread pool (tokenizing, templates)", "concurrent/futures/thread.py"),
         ("event loop (HTTP, SSE, relay; C calls under Runner.run are the loop's own)", "runners.py"))


def self_shares(raw: Path) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """From py-spy's raw output (`frame;frame;... count` per line): samples by thread role (the Python
    threads are unnamed to the OS, so a thread is told by what its stack runs) and by innermost
    function, and the total."""
    roles: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        roles[next((role for role, mark in ROLES if mark in stack), "other")] += int(count)
        functions[frames[-1]] += int(count)
        total += int(count)
    return roles, functions, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        parser.error("py-spy is not installed: it is a dev dependency (scripts/bootstrap.sh installs it)")
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="profile-stack-"))
    worker_flags = ["--model-path", str(model), "--threads", str(args.threads), "--max-sessions", str(args.streams),
                    "--session-max-tokens", "512", "--no-prompt-cache"]
    with pool(work, workers=[worker_flags], coordinator=["--queue-size", "1024"]) as running:
        pids = {"coordinator": pid_listening_on(int(running.url.rsplit(":", 1)[1])),
                "worker": pid_listening_on(int(running.worker_urls[0].rsplit(":", 1)[1]))}
        asyncio.run(load(running.url, min(args.streams, 8), 8, 2.0))  # warm-up
        before = {name: thread_cpu(pid) for name, pid in pids.items()}
        spies = {name: subprocess.Popen([str(spy), "record", "--pid", str(pid), "--format", "raw", "--threads",
                                         "--nonblocking", "--rate", "200", "--duration", str(int(args.seconds)),
                                         "--output", str(work / f"{name}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, pid in pids.items()}
        load_cpu = time.process_time()
        tokens = asyncio.run(load(running.url, args.streams, args.tokens, args.seconds))
        load_cpu = time.process_time() - load_cpu
        after = {name: thread_cpu(pid) for name, pid in pids.items()}
        for proc in spies.values():
            proc.wait(timeout=60)
    print(f"{args.streams} streams x {args.tokens} tokens through the coordinator, tiny model, {args.threads} "
          f"llama.cpp thread(s): {tokens} tokens in {args.seconds:g} s")
    print(f"load generator (this process): {load_cpu / tokens * 1e6:7.1f} us CPU per token")
    for name in pids:
        total = sum(after[name].values()) - sum(before[name].values())
        print(f"\n{name}: {total / tokens * 1e6:7.1f} us CPU per token")
        roles, functions, samples = self_shares(work / f"{name}.txt")
        for role, count in roles.most_common():
            print(f"  {count / samples * total / tokens * 1e6:7.1f} us  {role}")
        print(f"  innermost functions ({samples} samples), share of the process's CPU per token:")
        for function, count in functions.most_common(args.top):
            print(f"    {count / samples * total / tokens * 1e6:7.1f} us  {function[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
