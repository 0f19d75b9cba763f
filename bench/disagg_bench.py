"""Disaggregated prefill against colocated: when does prefilling on one worker and decoding on another pay?

Starts two real workers (1 llama.cpp thread each, the default model) and, per mode, a real coordinator
on loopback, then runs `--users` closed-loop users for `--duration` seconds through `/coordinator/infer`.
Every request is a prompt of about `--prompt-tokens` tokens that no worker has seen (a fresh number
starts it, so no cache helps), answered greedily with `--max-tokens` tokens.

Modes:
  colocated      the default: each request is prefilled and decoded on one worker
  disaggregated  DISAGGREGATE_PROMPT_BYTES=1000: the policy's first worker prefills it (one token),
                 another fetches its cells (`prefix_peer`) and decodes

Prints per mode requests/s, TTFT p50/p90, the time between tokens p50/p99 (a prefill on the same
worker stalls the streams decoding there) and the decoding workers' prompt tokens prefilled and
reused, and the ratios of the disaggregated mode against the colocated one.

    .venv/bin/python -m bench.disagg_bench [--users 4] [--duration 45] [--prompt-tokens 500] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.prefix_bench import prompt_counters
from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH

MODES = {"colocated": [], "disaggregated": ["--disaggregate-prompt-bytes", "1000"]}
SENTENCE = ("The keeper of the valley archive writes down every traveller's route, the weather on the pass "
            "and the state of the bridges, so that the next one knows what to expect. ")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else float("nan")


async def user(client: httpx.AsyncClient, url: str, index: int, stop_at: float, args: argparse.Namespace,
               ttfts: list[float], gaps: list[float], errors: list[str]) -> int:
    done, n = 0, 0
    while time.perf_counter() < stop_at:
        n += 1
        body = {"prompt": f"Traveller {index}-{n}-{time.time_ns()}. " + SENTENCE * max(1, args.prompt_tokens // 33),
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        started, last, first = time.perf_counter(), 0.0, None
        async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
            if response.status_code != 200:
                errors.append(str(response.status_code))
                await response.aread()
                continue
            async for line in response.aiter_lines():
                if not line.startswith("data: {\"token\""):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - started
                else:
                    gaps.append(now - last)
                last = now
        if first is None:
            errors.append("no token")
            continue
        ttfts.append(first)
        done += 1
    return done


def run_mode(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    worker = ["--threads", "1", "--max-sessions", "8", "--model-path", str(DEFAULT_MODEL_PATH)]

    async def load(url: str, seconds: float) -> tuple[float, list[float], list[float], list[str]]:
        ttfts: list[float] = []
        gaps: list[float] = []
        errors: list[str] = []
        async with httpx.AsyncClient(timeout=300) as client:
            started = time.perf_counter()
            counts = await asyncio.gather(*[user(client, url, u, started + seconds, args, ttfts, gaps, errors)
                                            for u in range(args.users)])
            return sum(counts) / (time.perf_counter() - started), ttfts, gaps, errors

    with pool(log_dir, workers=[worker, worker], coordinator=MODES[mode], name=mode) as running:
        asyncio.run(load(running.url, args.warmup))
        before = [prompt_counters(w, running.worker_token) for w in running.worker_urls]
        rps, ttfts, gaps, errors = asyncio.run(load(running.url, args.duration))
        after = [prompt_counters(w, running.worker_token) for w in running.worker_urls]
    prefilled, cached, _ = (sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in range(3))
    result = {"rps": rps, "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
              "gap_p50": percentile(gaps, 50), "gap_p99": percentile(gaps, 99)}
    print(f"{mode:>14}: {rps:5.2f} requests/s  TTFT p50 {result['ttft_p50'] * 1e3:7.0f} ms  p90 "
          f"{result['ttft_p90'] * 1e3:7.0f} ms  between tokens p50 {result['gap_p50'] * 1e3:5.0f} ms  p99 "
          f"{result['gap_p99'] * 1e3:6.0f} ms  ({len(ttfts)} requests, {len(errors)} errors; prompt tokens "
          f"prefilled {prefilled:,.0f}, reused {cached:,.0f})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--duration", type=float, default=45.0, help="seconds measured per mode")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of the same load before, not measured")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="colocated,disaggregated")
    args = parser.parse_args(argv)
    print(f"{args.users} users, {args.duration:g} s per mode after {args.warmup:g} s of warm-up, fresh prompts of "
          f"~{args.prompt_tokens} tokens, {args.max_tokens} tokens each (greedy); 2 workers x 1 llama.cpp thread")
    results = {}
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args, Path(tmp))
    if {"colocated", "disaggregated"} <= results.keys():
        c, d = results["colocated"], results["disaggregated"]
        print(f"disaggregated against colocated: requests/s {d['rps'] / c['rps']:.2f}x, TTFT p50 "
              f"{d['ttft_p50'] / c['ttft_p50']:.2f}x, between tokens p99 {d['gap_p99'] / c['gap_p99']:.2f}x "
              "(below 1: it pays)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
