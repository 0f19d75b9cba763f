"""One hostile request of each kind beside ordinary traffic: how much slower the ordinary chats get.

Owns: the kinds of costly request (each as large as the pool accepts), the ordinary chats they run
beside, the pool it starts (one coordinator, one worker with `--threads` llama.cpp threads, on
127.0.0.1) and the table it prints. Must not: change product code; the pool is stopped however the
run ends.

    .venv/bin/python -m bench.hostile_mix [--rounds 3] [--kinds long_prompt,...] [--worker-flag=--prefill-stall=0]

Each round measures the ordinary chats alone (`--chats` at once, 16 tokens each, end to end through
`/v1/chat/completions`), the kind's hostile requests alone (fresh ones, as every round's), then the
same chats started `--lead` seconds after the kind's hostile requests, and the hostile requests' own
latency beside them. Printed per kind: the chats' median and worst latency beside the kind over
alone, the hostile requests' median latency beside the chats over alone (each the median of the
rounds' ratios' parts, all from this one run), and what the hostile requests got. docs/reliability.md
keeps the table ("Every request's cost, bounded").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load.clients import post_timed
from bench.processes import code_version, pool

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "modelFiles" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}
HARBOUR = "Describe the harbour, the boats, the gulls and the weather in great detail. "


@dataclass(frozen=True)
class Hostile:
    path: str
    body: dict[str, Any]


def fresh() -> str:
    """A different start for each hostile prompt, so that no worker's prompt cache holds it."""
    return f"Request {time.perf_counter_ns()}. "


def long_prompt() -> list[Hostile]:
    """Two prompts of about 1,700 tokens, within every limit (a session holds 2,048)."""
    return [Hostile("/v1/chat/completions", {"messages": [{"role": "user", "content": fresh() + HARBOUR * 100}],
                                             "max_tokens": 1, "temperature": 0}) for _ in range(2)]


def echo() -> list[Hostile]:
    """Two prompts of about 1,700 tokens scored as an evaluation harness asks (`echo` with `logprobs`, one
    token generated): every prompt row's logits, in chunks of 64, none from the prompt cache. Beside
    `long_prompt`, the same prompts prefilled without scores."""
    return [Hostile("/v1/completions", {"prompt": fresh() + HARBOUR * 100, "max_tokens": 1, "temperature": 0,
                                        "logprobs": 1, "echo": True}) for _ in range(2)]


def grammar() -> list[Hostile]:
    """Eight answers held to a JSON schema of an array of a 20,000-value enum (about 300 KB)."""
    schema = {"type": "array", "items": {"enum": [f"value-{i:05d}" for i in range(20_000)]}}
    body = {"messages": [{"role": "user", "content": fresh() + "List some values."}], "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "values", "schema": schema}}}
    return [Hostile("/v1/chat/completions", body) for _ in range(8)]


def batch_of_eight() -> list[Hostile]:
    """The reference for `grammar`: the same eight requests without the schema, 64 tokens each (what
    eight more sequences in the batch cost the chats, whatever they are)."""
    body = {"messages": [{"role": "user", "content": fresh() + "List some values."}], "max_tokens": 64,
            "ignore_eos": True}
    return [Hostile("/v1/chat/completions", body) for _ in range(8)]


def ask(text: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": fresh() + text}], "max_tokens": 64, **fields}


def choices() -> list[Hostile]:
    """One request for the most choices a request may ask (MAX_CHOICES, 8), 64 tokens each."""
    return [Hostile("/v1/chat/completions", ask("Write a line about the sea.", n=8, ignore_eos=True))]


def tools() -> list[Hostile]:
    """24 functions offered (each with a described parameter): a prompt of about 1,700 tokens (32 pass a
    session's 2,048 and are refused with 400 `context_length_exceeded`)."""
    functions = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Looks up record {i} in the harbour office's ledger of boats.",
        "parameters": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "integer", "description": "the record's number"}}}}} for i in range(24)]
    return [Hostile("/v1/chat/completions", ask("Which boat came in first?", tools=functions, tool_choice="auto",
                                                max_tokens=1))]


def logit_bias() -> list[Hostile]:
    """The most biases a request may carry (300), on a sampled answer."""
    return [Hostile("/v1/chat/completions", ask("Name some fish.", logit_bias={str(t): 5 for t in range(300)},
                                                temperature=0.8, ignore_eos=True))]


def stops() -> list[Hostile]:
    """The most stop strings (8) of the longest length (64), never met."""
    return [Hostile("/v1/chat/completions", ask("Count to a hundred.", ignore_eos=True,
                                                stop=[f"{i}" * 64 for i in range(8)]))]


def logprobs() -> list[Hostile]:
    """Log-probabilities of every token, with the largest `top_logprobs` the pool serves (1)."""
    return [Hostile("/v1/chat/completions", ask("Describe a gull.", logprobs=True, top_logprobs=1,
                                                ignore_eos=True))]


def embeddings() -> list[Hostile]:
    """The largest /v1/embeddings request the pool accepts: 256 inputs of about 500 tokens."""
    text = HARBOUR * 28
    return [Hostile("/v1/embeddings", {"input": [fresh() + text for _ in range(256)]})]


KINDS: dict[str, Callable[[], list[Hostile]]] = {
    "long_prompt": long_prompt, "echo": echo, "grammar": grammar, "batch_of_eight": batch_of_eight, "choices": choices,
    "tools": tools, "logit_bias": logit_bias, "stops": stops, "logprobs": logprobs, "embeddings": embeddings}


async def timed(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[float, int]:
    """One whole request through the load tool (bench/load/clients.py): its seconds and its status."""
    record = await post_timed(client, url + path, body)
    if not record.ok:
        print(f"  {path}: {record.error_key}", flush=True)
    seconds = record.e2e if record.e2e is not None else time.perf_counter() - record.sent_at
    return seconds, record.status or 0


async def chats(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    results = await asyncio.gather(*(timed(client, url, "/v1/chat/completions", CHAT) for _ in range(n)))
    bad = [status for _, status in results if status != 200]
    if bad:
        raise RuntimeError(f"ordinary chats refused: {bad}")
    return [seconds for seconds, _ in results]


def spread(results: list[tuple[float, int]]) -> str:
    """Each hostile request's seconds, shortest first (two prompts on one worker go one after the other)."""
    return "/".join(f"{seconds:.1f}" for seconds in sorted(s for s, _ in results)) + " s"


async def measure(url: str, kinds: list[str], rounds: int, n_chats: int, lead: float) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        await chats(client, url, n_chats)  # warm: the chat's prompt is in the prompt cache from here on
        for kind in kinds:
            alone: list[list[float]] = []
            beside: list[list[float]] = []
            hostile: list[list[tuple[float, int]]] = []
            hostile_alone: list[list[tuple[float, int]]] = []
            for _ in range(rounds):
                alone.append(await chats(client, url, n_chats))
                hostile_alone.append(list(await asyncio.gather(
                    *(timed(client, url, h.path, h.body) for h in KINDS[kind]()))))
                requests = KINDS[kind]()
                running = [asyncio.create_task(timed(client, url, h.path, h.body)) for h in requests]
                await asyncio.sleep(lead)  # the hostile requests are in before the chats come
                beside.append(await chats(client, url, n_chats))
                hostile.append(list(await asyncio.gather(*running)))
                chats_x = statistics.median(beside[-1]) / statistics.median(alone[-1])
                hostile_x = (statistics.median(s for s, _ in hostile[-1])
                             / statistics.median(s for s, _ in hostile_alone[-1]))
                print(f"  {kind}: chats {statistics.median(alone[-1]) * 1e3:.0f} ms alone, "
                      f"{statistics.median(beside[-1]) * 1e3:.0f} ms beside ({chats_x:.2f}x); hostile, each: "
                      f"{spread(hostile_alone[-1])} alone, {spread(hostile[-1])} beside ({hostile_x:.2f}x)",
                      flush=True)
            a_med = statistics.median(statistics.median(r) for r in alone)
            a_max = statistics.median(max(r) for r in alone)
            b_med = statistics.median(statistics.median(r) for r in beside)
            b_max = statistics.median(max(r) for r in beside)
            h_lat = statistics.median(statistics.median(s for s, _ in r) for r in hostile)
            h_alone = statistics.median(statistics.median(s for s, _ in r) for r in hostile_alone)
            statuses = sorted({status for r in hostile for _, status in r})
            rows.append({"kind": kind, "alone_ms": a_med * 1e3, "beside_ms": b_med * 1e3, "median_x": b_med / a_med,
                         "worst_x": b_max / a_max, "hostile_alone_ms": h_alone * 1e3, "hostile_ms": h_lat * 1e3,
                         "hostile_x": h_lat / h_alone, "hostile_status": statuses})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=4, help="ordinary chats at once")
    parser.add_argument("--lead", type=float, default=0.3, help="seconds the hostile requests start before the chats")
    parser.add_argument("--threads", type=int, default=1, help="the worker's llama.cpp threads")
    parser.add_argument("--worker-flag", action="append", default=[], help="an extra worker flag (repeatable)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds: {unknown}")
    worker = ["--model-path", str(args.model), "--threads", str(args.threads), *args.worker_flag]
    print(f"code: {code_version()}; worker flags: {' '.join(worker[2:])}; {args.chats} chats of 16 tokens, "
          f"{args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory() as logs, pool(Path(logs), workers=[worker], timeout=120) as running:
        rows = asyncio.run(measure(running.url, kinds, args.rounds, args.chats, args.lead))
    print(f"{'kind':<16} {'chats alone':>12} {'beside':>10} {'median':>8} {'worst':>8} {'hostile alone':>14} "
          f"{'beside chats':>13} {'hostile':>8}  status")
    for row in rows:
        print(f"{row['kind']:<16} {row['alone_ms']:>9.0f} ms {row['beside_ms']:>7.0f} ms {row['median_x']:>7.2f}x "
              f"{row['worst_x']:>7.2f}x {row['hostile_alone_ms']:>11.0f} ms {row['hostile_ms']:>10.0f} ms "
              f"{row['hostile_x']:>7.2f}x  {row['hostile_status']}")
    worst = max(rows, key=lambda r: r["worst_x"])
    print(f"worst slowdown: {worst['worst_x']:.2f}x ({worst['kind']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
