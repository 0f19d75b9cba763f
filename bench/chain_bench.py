"""A stored Responses chain's next turn against a fresh request: time to first token, through the other
coordinator of two (issue 49).

    .venv/bin/python -m bench.chain_bench [--rounds 8] [--instructions-repeat 12]

Starts a pool of two coordinators and two workers (SmolLM2, 1 llama.cpp thread each, 4 sequences, split
KV) on loopback. Each round: a first turn through coordinator A (long instructions and a question,
streamed); then, through coordinator B, (1) the next turn with `previous_response_id` and only the new
input, over HTTP, (2) the same over B's WebSocket, and (3) a request whose prompt is only that new input
(no instructions, no history). Each new input is about 40 tokens after a nonce, so no prompt cache holds
any of it; a chain's turn must also prefill the chat template's turn boundary after the stored answer
(about 6 tokens), which is what the ratio pays beyond the new input itself. Prints the median time to the first `response.output_text.delta` of
each, the chain turns' ratio to (3) (the goal: at most 1.2x), and the share of their input tokens the
worker reused (`cached_tokens`). Timings are wall times on a shared machine: the ratio, taken from the
same rounds, is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.processes import pool

MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
WORKER = ["--threads", "1", "--max-sessions", "4"]
INSTRUCTIONS = ("You are a careful assistant for a small gardening shop. You answer in one short sentence, "
                "name plants by their common names, and never give prices. ")
# Each turn's new input, as an agent's next turn might be (a question with some context): about 40 tokens,
# after a nonce no earlier prompt starts with, so no prompt cache holds any of it.
FOLLOW_UP = ("{nonce}: the customer says the bed gets morning sun, the soil is heavy clay that stays wet after "
             "rain, and they want something that flowers in late summer. Which {color} flower would you suggest?")


async def _http_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds to the first text delta, the final response) of one streamed request."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/responses", json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                return first if first is not None else time.perf_counter() - started, event["response"]
    raise RuntimeError("the stream ended without a final event")


async def _socket_turn(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/responses") as ws:
        started = time.perf_counter()
        first = None
        await ws.send(json.dumps({"type": "response.create", **body}))
        async for message in ws:
            event = json.loads(message)
            if event["type"] == "error":
                raise RuntimeError(str(event))
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                return first if first is not None else time.perf_counter() - started, event["response"]
    raise RuntimeError("the socket closed without a final event")


def _new_input(color: str) -> str:
    return FOLLOW_UP.format(nonce=secrets.token_hex(3), color=color)


def _cached_share(response: dict[str, Any]) -> float:
    usage = response["usage"]
    return float(usage["input_tokens_details"]["cached_tokens"]) / max(1, usage["input_tokens"])


async def _rounds(a: str, b: str, rounds: int, instructions: str) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"http": [], "socket": [], "fresh": [], "http_cached": [], "socket_cached": []}
    common = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
    async with httpx.AsyncClient(timeout=120) as client:
        for r in range(rounds):
            _, first = await _http_turn(client, a, {**common, "instructions": instructions,
                                                    "input": f"Round {r}: name a red flower."})
            follow = {**common, "instructions": instructions, "previous_response_id": first["id"]}
            seconds, http = await _http_turn(client, b, {**follow, "input": _new_input("blue")})
            figures["http"].append(seconds)
            figures["http_cached"].append(_cached_share(http))
            seconds, sock = await _socket_turn(b, {**follow, "previous_response_id": http["id"],
                                                   "input": _new_input("white")})
            figures["socket"].append(seconds)
            figures["socket_cached"].append(_cached_share(sock))
            # A new input of the same length the pool has not seen (its chat template's own lines it has).
            seconds, _ = await _http_turn(client, b, {**common, "input": _new_input("pink"), "store": False})
            figures["fresh"].append(seconds)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--instructions-repeat", type=int, default=12,
                        help="times the instructions' sentence is repeated (12: about 400 tokens)")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="the workers' WORKER_FLASH_ATTN (on this CPU, off prefills deep in a conversation faster)")
    args = parser.parse_args(argv)
    worker = [*WORKER, "--flash-attn", args.flash_attn]
    with tempfile.TemporaryDirectory(prefix="chain-bench-") as logs, \
            pool(Path(logs), workers=[worker, worker], coordinators=2) as running:
        a, b = running.urls
        figures = asyncio.run(_rounds(a, b, args.rounds, INSTRUCTIONS * args.instructions_repeat))
    fresh = statistics.median(figures["fresh"])
    print(f"chain turns through the other coordinator of 2, {args.rounds} rounds, 2 workers x 1 thread, "
          f"flash attention {args.flash_attn}:")
    print(f"  prompt of only the new input: TTFT p50 {fresh * 1000:7.1f} ms")
    for kind in ("http", "socket"):
        ttft = statistics.median(figures[kind])
        print(f"  next turn over {kind:6}:        TTFT p50 {ttft * 1000:7.1f} ms  = {ttft / fresh:4.2f}x  "
              f"(goal <= 1.2x); cached share p50 {statistics.median(figures[kind + '_cached']):.2f} (goal >= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
