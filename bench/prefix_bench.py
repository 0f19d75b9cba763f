"""Shared prefixes: many users, a few long system prompts, prefix-aware routing against load alone.

Starts two real workers and, per mode, a real coordinator on loopback, then runs `--users` closed-loop
users for `--duration` seconds through `/v1/chat/completions`. Each request is one of `--prompts`
distinct system prompts of about `--system-tokens` tokens (chosen by a seeded random draw) plus a short
question, answered greedily with `--max-tokens` tokens. Prints requests/s and client-side TTFT
(p50, p90) per mode, and the ratios against the baselines.

Modes (the same workers' settings except the prompt cache):
  prefix    --scorers session_load:0.6,kv_load:0.4,prefix:1, workers' prompt cache on
  load      the 60/40 scorers alone, workers' prompt cache on (each worker reuses what it happens to hold)
  none      the 60/40 scorers alone, workers' prompt cache off (every prompt prefilled)

Workers keep `--sessions` sequences each: fewer than the prompts times workers, as KV is in a real pool,
so which worker a prompt goes to decides whether its prefix is still held.

    .venv/bin/python -m bench.prefix_bench [--users 8] [--duration 60] [--warmup 30] [--sessions 4] [--threads 1]
        [--keys none|per-user|shared] [--coordinators 1,2]

`--coordinators 1,2` runs each mode with one coordinator, then with two (issue 20): the workers
heartbeat to both, and the users are split over them (user u sends to coordinator u mod 2), so with
prefix-aware routing each coordinator must know the prefixes the other sent, from the workers'
heartbeats (`WorkerLoad.prefixes`).

`--keys` (tenancy, docs/reliability.md): `none` starts the coordinator without client keys (one tenant,
everyone shares every prefix); `per-user` gives it one API key per user and each user sends its own, so
each user is its own tenant and reuses only the prefixes it filled itself; `shared` the same keys, all of
one named tenant (`KEY team` entries), which share prefixes again.

Besides the client's figures, each mode prints the workers' prompt-token counters over the measured
part: tokens prefilled (and by each worker), tokens reused from cells, and of those the ones copied from
another sequence; the hit rate is the reused tokens' share of all prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.load.clients import OpenAIChatClient, Sampling
from bench.load.workload import SEED_RANGE, WorkItem
from bench.processes import pool
from bench.worker_token import auth_headers
from worker.provision import DEFAULT_MODEL_PATH

TOPICS = ("a lighthouse keeper", "a ship's cook", "a mountain guide", "a beekeeper", "a night-train conductor",
          "a museum guard", "a glassblower", "a radio operator", "a cartographer", "a baker")
QUESTIONS = ("What did you do today?", "What is hard about it?", "Any advice?", "What do you see now?",
             "Tell me something surprising.", "What do you eat?")
MODES = {
    "prefix": (["--scorers", "session_load:0.6,kv_load:0.4,prefix:1"], []),
    "load": ([], []),
    "none": ([], ["--no-prompt-cache"]),
}
KEYS = ("none", "per-user", "shared")
SHARED_TENANT = "team"


def user_keys(keys: str, users: int) -> tuple[str | None, list[str | None]]:
    """For `--keys`: the coordinator's API_KEYS setting (None: no keys) and each user's key."""
    if keys == "none":
        return None, [None] * users
    mine = [f"bench-user{u}-{secrets.token_hex(8)}" for u in range(users)]
    if keys == "per-user":
        return ",".join(mine), list(mine)
    if keys == "shared":
        return ",".join(f"{key} {SHARED_TENANT}" for key in mine), list(mine)
    raise ValueError(f"--keys: one of {', '.join(KEYS)}, not {keys!r}")


def system_prompt(i: int, tokens: int) -> str:
    who = TOPICS[i % len(TOPICS)]
    sentence = (f"You are {who}, number {i}. You speak plainly, you remember the small details of your work, "
                "and you answer every visitor's question in one or two short sentences. ")
    return sentence * max(1, tokens // 30)  # about 30 tokens a sentence


async def user(http: httpx.AsyncClient, url: str, systems: list[str], rng: random.Random, stop_at: float,
               max_tokens: int, ttfts: list[float], errors: list[str], key: str | None = None) -> int:
    """One closed-loop user: a greedy streamed chat (a system prompt drawn from `systems`, a question) at a
    time until `stop_at`, through the load tool's chat client (bench/load/clients.py); its TTFT is the
    first chunk with content."""
    client = OpenAIChatClient(url, Sampling(max_tokens=max_tokens, temperature=0.0), timeout=300,
                              headers={"authorization": f"Bearer {key}"} if key else None)
    done = 0
    while time.perf_counter() < stop_at:
        item = WorkItem(index=done, prompt=rng.choice(QUESTIONS), seed=rng.randrange(SEED_RANGE),
                        system=rng.choice(systems))
        record = await client.send(http, item)
        if not record.ok or record.ttft is None:
            errors.append(record.error_key or "no content")
            continue
        ttfts.append(record.ttft)
        done += 1
    return done


def run_mode(mode: str, args: argparse.Namespace, log_dir: Path, systems: list[str],
             coordinators: int = 1, fair: str = "on") -> tuple[float, list[float], list[str], float]:
    coordinator_extra, worker_extra = MODES[mode]
    coordinator_extra = [*coordinator_extra, "--fair-share", "true" if fair == "on" else "false"]
    if mode == "prefix" and args.balance_threshold is not None:
        coordinator_extra = [*coordinator_extra, "--prefix-balance-threshold", str(args.balance_threshold)]
    worker = ["--threads", str(args.threads), "--max-sessions", str(args.sessions), "--session-max-tokens", "1024",
              "--model-path", str(DEFAULT_MODEL_PATH), *worker_extra]
    api_keys, keys = user_keys(args.keys, args.users)

    async def load(urls: tuple[str, ...], seconds: float, seed: int) -> tuple[float, list[float], list[str]]:
        ttfts: list[float] = []
        errors: list[str] = []
        async with httpx.AsyncClient(timeout=300) as client:
            started = time.perf_counter()
            counts = await asyncio.gather(*[
                user(client, urls[u % len(urls)], systems, random.Random(seed * 100 + u), started + seconds,
                     args.max_tokens, ttfts, errors, keys[u]) for u in range(args.users)])
            elapsed = time.perf_counter() - started
        return sum(counts) / elapsed, ttfts, errors

    with pool(log_dir, workers=[worker, worker], coordinator=coordinator_extra, api_keys=api_keys,
              name=f"{mode}-{coordinators}-{fair}", coordinators=coordinators) as running:
        if args.warmup > 0:  # the same load, not measured: the caches fill as they would in service
            asyncio.run(load(running.urls, args.warmup, args.seed + 1))
        before = [prompt_counters(w, running.worker_token) for w in running.worker_urls]
        result = asyncio.run(load(running.urls, args.duration, args.seed))
        after = [prompt_counters(w, running.worker_token) for w in running.worker_urls]
    prefilled, cached, copied = (sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in range(3))
    by_worker = " / ".join(f"{a[0] - b[0]:,.0f}" for a, b in zip(after, before, strict=True))
    hit_rate = cached / max(prefilled + cached, 1)
    print(f"         prompt tokens while measured: {prefilled:,.0f} prefilled ({by_worker} by worker), "
          f"{cached:,.0f} reused (of those {copied:,.0f} copied from another sequence): hit rate {hit_rate:.3f}")
    return (*result, hit_rate)


def prompt_counters(worker_url: str, worker_token: str) -> tuple[float, float, float]:
    """The worker's (prefilled, reused, copied) prompt-token counters."""
    values = {}
    response = httpx.get(worker_url + "/metrics", headers=auth_headers(worker_token), timeout=10)
    for line in response.raise_for_status().text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return tuple(float(values.get(f"worker_{n}_total", "nan"))  # type: ignore[return-value]
                 for n in ("prompt_tokens", "cached_prompt_tokens", "copied_prompt_tokens"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per mode")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of the same load before, not measured")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=4, help="sequences per worker")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", default="prefix,load,none")
    parser.add_argument("--keys", choices=KEYS, default="none",
                        help="client API keys: none; per-user (one key each, each its own tenant); shared (the "
                        "same keys, all of one tenant)")
    parser.add_argument("--coordinators", default="1",
                        help="coordinator counts to run each mode with, e.g. 1,2 (users split over them)")
    parser.add_argument("--balance-threshold", type=float, default=None,
                        help="the coordinator's --prefix-balance-threshold in the prefix mode (its default otherwise)")
    parser.add_argument("--fair", default="on", help="on, off or on,off: the coordinator's FAIR_SHARE (it orders "
                        "tenants only with keys: --keys per-user or shared); with both, each mode runs twice")
    args = parser.parse_args(argv)
    systems = [system_prompt(i, args.system_tokens) for i in range(args.prompts)]
    print(f"{args.users} users, {args.duration:g} s per mode after {args.warmup:g} s of warm-up, {args.prompts} system prompts of ~{args.system_tokens} "
          f"tokens, answers of {args.max_tokens} tokens (greedy); 2 workers x {args.threads} llama.cpp thread(s) x "
          f"{args.sessions} sequences; keys: {args.keys}")
    results: dict[str, tuple[float, float, float]] = {}  # by mode, and coordinators when more than one count
    counts = [int(n) for n in args.coordinators.split(",")]
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        fairs = args.fair.split(",")
        for mode, n, fair in [(m, n, f) for m in args.modes.split(",") for n in counts for f in fairs]:
            label = (mode if counts == [1] else f"{mode}/{n}c") + (f"/fair-{fair}" if len(fairs) > 1 else "")
            rps, ttfts, errors, hit_rate = run_mode(mode, args, Path(tmp), systems, n, fair)
            p50 = statistics.median(ttfts) * 1e3 if ttfts else float("nan")
            p90 = statistics.quantiles(ttfts, n=10)[-1] * 1e3 if len(ttfts) >= 10 else float("nan")
            results[label] = (rps, p50, hit_rate)
            print(f"{label:>9}: {rps:6.2f} requests/s  TTFT p50 {p50:8.1f} ms  p90 {p90:8.1f} ms  hit rate "
                  f"{hit_rate:.3f}  ({len(ttfts)} requests, {len(errors)} errors"
                  f"{': ' + ', '.join(sorted(set(errors))) if errors else ''})")
    for mode in args.modes.split(","):
        on, off = results.get(f"{mode}/fair-on"), results.get(f"{mode}/fair-off")
        if on is not None and off is not None:
            print(f"{mode}, fair shares on against off: hit rate {on[2] / max(off[2], 1e-9):.2f}x, requests/s "
                  f"{on[0] / off[0]:.2f}x, TTFT p50 {off[1] / on[1]:.2f}x lower")
    if "prefix" in results:
        for base in ("load", "none"):
            if base in results:
                rps, p50, _ = results[base]
                print(f"prefix vs {base}: requests/s {results['prefix'][0] / rps:.2f}x, "
                      f"TTFT p50 {p50 / results['prefix'][1]:.2f}x lower")
    for mode in args.modes.split(","):
        one = results.get(f"{mode}/1c")
        if one is None:
            continue
        for n, (rps, p50, hit_rate) in [(n, results[f"{mode}/{n}c"]) for n in counts if n > 1]:
            print(f"{mode} with {n} coordinators against 1: hit rate {hit_rate / max(one[2], 1e-9):.2f}x, "
                  f"requests/s {rps / one[0]:.2f}x, TTFT p50 {one[1] / p50:.2f}x lower")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
