"""Big chat bodies beside normal streams, against a running pool: how fast the hostile ones are
refused, whether any normal request fails or any breaker opens, and how much the normal streams'
longest gap between tokens grows (a ratio against the same streams run alone, just before).

    ./start.sh --port 1611 --worker-port 3621 &
    .venv/bin/python -m bench.big_bodies --url http://127.0.0.1:1611 [--hostile 6] [--normal 10] [--rounds 3]

A hostile body is issue 23's: 1,024 chat messages of 3,000 characters (about 3 MB), sent to
`/v1/chat/completions` at once with the normal streams' start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

HOSTILE = {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 3_000} for _ in range(1_024)]}


@dataclass
class Normal:
    ok: bool
    longest_gap_s: float


async def normal(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> Normal:
    body = {"prompt": f"Tell a story about the number {i}.", "max_tokens": tokens, "ignore_eos": True}
    last, longest, finished = None, 0.0, False
    async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
        if response.status_code != 200:
            return Normal(False, 0.0)
        async for line in response.aiter_lines():
            if line.startswith("event: token"):
                now = time.monotonic()
                if last is not None:
                    longest = max(longest, now - last)
                last = now
            elif line.startswith("event: done"):
                finished = True
    return Normal(finished, longest)


async def hostile(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    started = time.monotonic()
    response = await client.post(url + "/v1/chat/completions", json=HOSTILE)
    return response.status_code, time.monotonic() - started


async def one_round(url: str, hostiles: int, normals: int, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=120) as client:
        alone = await asyncio.gather(*(normal(client, url, i, tokens) for i in range(normals)))
        mixed = await asyncio.gather(*(hostile(client, url) for _ in range(hostiles)),
                                     *(normal(client, url, i, tokens) for i in range(normals)))
        listing = (await client.get(url + "/coordinator/health/workers")).json()["workers"]
    refusals = [r for r in mixed[:hostiles] if isinstance(r, tuple)]
    beside = [r for r in mixed[hostiles:] if isinstance(r, Normal)]
    # The OpenAI routes answer OpenAI's 400 `context_length_exceeded` (413 `prompt_too_long` before 2026-11-25).
    return {"hostile_refused": sum(1 for status, _ in refusals if status in (400, 413)),
            "hostile_slowest_s": max((took for _, took in refusals), default=0.0),
            "normal_failed": sum(1 for r in alone + beside if not r.ok),
            "breakers_not_closed": sum(1 for w in listing if w["breaker"] != "closed"),
            "gap_alone_ms": max(r.longest_gap_s for r in alone) * 1e3,
            "gap_beside_ms": max(r.longest_gap_s for r in beside) * 1e3}


async def run(url: str, hostiles: int, normals: int, tokens: int, rounds: int) -> int:
    print(f"{hostiles} hostile 3 MB chat bodies beside {normals} streams of {tokens} tokens, {rounds} rounds "
          "(each: the streams alone, then with the hostile bodies)")
    print(f"{'round':>5} {'refused':>7} {'slowest':>10} {'failed':>7} {'breakers':>9} "
          f"{'gap alone':>10} {'gap beside':>11} {'ratio':>6}")
    ratios, bad = [], 0
    for n in range(1, rounds + 1):
        r = await one_round(url, hostiles, normals, tokens)
        ratio = r["gap_beside_ms"] / r["gap_alone_ms"] if r["gap_alone_ms"] else float("inf")
        ratios.append(ratio)
        bad += (r["hostile_refused"] != hostiles) + (r["normal_failed"] > 0) + (r["breakers_not_closed"] > 0)
        print(f"{n:>5} {r['hostile_refused']:>7.0f} {r['hostile_slowest_s']:>9.2f}s {r['normal_failed']:>7.0f} "
              f"{r['breakers_not_closed']:>9.0f} {r['gap_alone_ms']:>8.1f}ms {r['gap_beside_ms']:>9.1f}ms "
              f"{ratio:>5.2f}x")
    print(f"median longest-gap ratio (beside / alone): {statistics.median(ratios):.2f}x")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--hostile", type=int, default=6)
    parser.add_argument("--normal", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    return asyncio.run(run(args.url.rstrip("/"), args.hostile, args.normal, args.tokens, args.rounds))


if __name__ == "__main__":
    sys.exit(main())
