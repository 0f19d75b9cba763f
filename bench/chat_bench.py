"""Multi-turn chat through `/v1/chat/completions`: time to first token by turn, with and without
conversation affinity and prefix reuse.

OpenAI clients resend the whole conversation every turn. With affinity the coordinator sends a next
turn to the worker that served the previous one, whose freed sequence still holds the conversation,
so that worker prefills only the new messages. Starts a real coordinator and two real workers on
loopback per mode, then runs `--conversations` conversations at once, `--turns` turns each (a long
system prompt of its own, short user messages, greedy answers of `--max-tokens`), and prints the client-side
TTFT (request sent to first content chunk) of every turn: medians over conversations and repeats.

Modes:
  affinity  the default: conversation affinity on, workers' prompt cache on
  cache     prompt cache on, affinity off (--conversation-table-size 0): a next turn lands wherever
            the score sends it, and finds its prefix only if that is the same worker
  none      neither: every turn prefills the whole conversation

    .venv/bin/python -m bench.chat_bench [--conversations 4] [--turns 5] [--repeat 3] [--threads 1] [--think-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH

SYSTEM = ("You are the keeper of a lighthouse on a small northern island. You write a log every night: "
          "the wind, the ships that pass, the colour of the sea, and the names of the gulls you have come "
          "to know. You answer visitors' questions briefly and kindly, in the voice of your log. ") * 6
QUESTIONS = ("What did you see tonight?", "Which ship was it?", "And the weather?", "Any gulls?",
             "What will you write tomorrow?", "Are you tired?", "Good night?")
MODES = {
    "affinity": ([], []),
    "cache": (["--conversation-table-size", "0"], []),
    "none": (["--conversation-table-size", "0"], ["--no-prompt-cache"]),
}


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
               ) -> tuple[float, str, int]:
    """One streamed turn: (TTFT seconds, the answer, cached prompt tokens from usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, ttft, text, cached = time.perf_counter(), None, [], -1
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(content)
    if ttft is None:
        raise RuntimeError("no content in the answer")
    return ttft, "".join(text), cached


async def conversation(client: httpx.AsyncClient, url: str, visitor: int, turns: int, max_tokens: int,
                       think: random.Random, think_s: float) -> list[tuple[float, int]]:
    """One visitor's conversation. Each has its own system prompt from its first words on (as users of
    different applications do), so only the worker that served a conversation holds its prefix."""
    messages = [{"role": "system", "content": f"Visitor {visitor} is talking to you. {SYSTEM}"}]
    out = []
    for i in range(turns):
        # A person reads and types: turns of different conversations do not arrive in lockstep.
        await asyncio.sleep(think.uniform(0.0, think_s))
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        ttft, answer, cached = await turn(client, url, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        out.append((ttft, cached))
    return out


def run_mode(mode: str, args: argparse.Namespace, log_dir: Path) -> list[list[tuple[float, int]]]:
    coordinator_extra, worker_extra = MODES[mode]
    worker = ["--threads", str(args.threads), "--max-sessions", "8", "--session-max-tokens", "2048",
              "--model-path", str(DEFAULT_MODEL_PATH), *worker_extra]

    async def rep(url: str, r: int) -> list[list[tuple[float, int]]]:
        async with httpx.AsyncClient(timeout=300) as client:
            await turn(client, url, [{"role": "user", "content": "Hello"}], 4)  # warm-up
            # The same seeded think times in every mode, a fresh visitor per conversation and repeat.
            return list(await asyncio.gather(*[
                conversation(client, url, r * args.conversations + k, args.turns, args.max_tokens,
                             random.Random(1000 * r + k), args.think_ms / 1000)
                for k in range(args.conversations)]))

    with pool(log_dir, workers=[worker, worker], coordinator=coordinator_extra, name=mode) as running:
        results = []
        for r in range(args.repeat):
            results.extend(asyncio.run(rep(running.url, r)))
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4, help="conversations at once")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per worker")
    parser.add_argument("--modes", default="affinity,cache,none")
    parser.add_argument("--think-ms", type=float, default=1000.0,
                        help="each turn waits a seeded random 0 to this many ms before it is sent")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    print(f"{args.conversations} conversations at once x {args.turns} turns x {args.repeat} repeats, "
          f"2 workers x {args.threads} llama.cpp thread(s), answers of {args.max_tokens} tokens (greedy), "
          f"0-{args.think_ms:g} ms think time before each turn")
    medians: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="chat-bench-") as tmp:
        for mode in modes:
            runs = run_mode(mode, args, Path(tmp))
            medians[mode] = [statistics.median(r[i][0] for r in runs) * 1e3 for i in range(args.turns)]
            cached = [statistics.median(r[i][1] for r in runs) for i in range(args.turns)]
            print(f"{mode:>9}: TTFT ms by turn " + "  ".join(f"{m:7.1f}" for m in medians[mode])
                  + "   cached prompt tokens by turn " + " ".join(str(int(c)) for c in cached))
    last = args.turns - 1
    if "affinity" in medians:
        for mode in modes:
            if mode != "affinity":
                print(f"turn {args.turns} TTFT, {mode} / affinity = {medians[mode][last] / medians['affinity'][last]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
