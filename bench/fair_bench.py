"""Fair under overload: what one API key's flood does to another key's requests, and how two flooding
keys share the pool (issue 35).

Starts a real pool (`--workers` workers of `--max-sessions` sequences each, the default model, as
`./start.sh` runs it) with two keys in two tenants, then runs two scenarios, each with fair shares
on and off (the coordinator's `FAIR_SHARE`):

- `flood`: the light key's clients alone for `--alone` seconds (its baseline), then beside the heavy
  key's clients, which join, for `--duration` seconds. Printed: the light key's TTFT p50/p99 alone and under the
  flood, its answers, its refusals; the heavy key's answers and refusals by status and reason.
- `shares`: both keys flood with the same load for `--duration` seconds; each key's share of the
  weighted tokens (prompt + 2 x generated, read from the coordinator's per-tenant token counters)
  in each `--window`-second window, and over the whole run. `--weights` sets the tenants' weights.
- `preempt`: the light key's requests one at a time (`--probes` of them) on the idle pool, then
  while the heavy key's `--batch-clients` clients hold every sequence with long answers
  (`--batch-tokens`), first with the heavy key's requests in the batch class (an interactive request
  parks one of them), then in the interactive class (no parking: it waits for a sequence to end).
  Printed: the light key's TTFT per probe, idle and busy, one decode step of the busy pool (the batch
  streams' median gap between tokens), the target (2 x the idle TTFT + one step), and the batch
  requests' answers and refusals (a parked one must still complete).

Every client is closed-loop (its next request when the last one ends), streams `POST
/coordinator/infer` with `ignore_eos` (exact lengths), and stops by itself at the deadline.
Usage: python -m bench.fair_bench [--scenario flood|shares|preempt] [--fair on|off|both] [--coordinators N]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.load.clients import InferClient, Sampling
from bench.load.record import RequestRecord
from bench.load.workload import PROMPTS, WorkItem
from bench.processes import code_version, pool
from worker.provision import DEFAULT_MODEL_PATH

KEYS = {"heavy": "bench-heavy-key", "light": "bench-light-key"}
PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # the coordinator's defaults (FAIR_PROMPT_WEIGHT, FAIR_OUTPUT_WEIGHT)


@dataclass
class Side:
    """One key's clients and what they got."""

    name: str
    clients: int
    max_tokens: int
    records: list[RequestRecord] = field(default_factory=list)

    def answers(self) -> int:
        return sum(r.ok for r in self.records)

    def refusals(self) -> Counter[str]:
        return Counter(f"{r.status or r.failure} {r.reason}".strip() for r in self.records if not r.ok)

    def ttft_ms(self, q: float) -> float | None:
        values = sorted(r.ttft for r in self.records if r.ok and r.ttft is not None)
        if not values:
            return None
        return 1000 * values[min(len(values) - 1, int(q * len(values)))]


async def run_side(url: str, side: Side, key: str, deadline: float, http: httpx.AsyncClient) -> None:
    client = InferClient(url, Sampling(max_tokens=side.max_tokens, ignore_eos=True), timeout=120,
                         headers={"authorization": f"Bearer {key}"})

    async def user(u: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            item = WorkItem(index=u * 100_000 + n, prompt=PROMPTS[(u + n) % len(PROMPTS)], seed=u * 1000 + n)
            record = await client.send(http, item)
            if time.perf_counter() <= deadline + 1 or record.ok:
                side.records.append(record)
            if not record.ok and record.status in (429, 503):
                await asyncio.sleep(0.05)  # a refused user retries soon, not at once
            n += 1

    await asyncio.gather(*(user(u) for u in range(side.clients)))


def tenant_tokens(urls: Sequence[str], key: str) -> dict[str, float]:
    """Weighted tokens served per tenant so far, summed over the coordinators' /metrics."""
    served: dict[str, float] = {}
    for url in urls:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=10).text
        for line in text.splitlines():
            if not line.startswith("coordinator_tenant_tokens_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
            weight = OUTPUT_WEIGHT if 'kind="generated"' in labels else PROMPT_WEIGHT
            served[tenant] = served.get(tenant, 0.0) + weight * float(value)
    return served


async def flood(urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """The light key's clients run throughout; the heavy key's start `--alone` seconds in."""
    light = Side("light", args.light_clients, args.light_tokens)
    heavy = Side("heavy", args.heavy_clients, args.heavy_tokens)
    limits = httpx.Limits(max_connections=args.heavy_clients + 2 * args.light_clients + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        flood_at = time.perf_counter() + args.alone
        deadline = flood_at + args.duration

        async def heavy_side() -> None:
            await asyncio.sleep(max(0.0, flood_at - time.perf_counter()))
            await run_side(urls[0], heavy, KEYS["heavy"], deadline, http)

        await asyncio.gather(heavy_side(), run_side(urls[-1], light, KEYS["light"], deadline, http))
    alone = Side("light", light.clients, light.max_tokens, [r for r in light.records if r.sent_at < flood_at])
    beside = Side("light", light.clients, light.max_tokens, [r for r in light.records if r.sent_at >= flood_at])
    return {
        "light_ttft_p50_alone_ms": alone.ttft_ms(0.5), "light_ttft_p99_alone_ms": alone.ttft_ms(0.99),
        "light_answers_alone": alone.answers(),
        "light_ttft_p50_ms": beside.ttft_ms(0.5), "light_ttft_p99_ms": beside.ttft_ms(0.99),
        "light_answers": beside.answers(), "light_refused": dict(beside.refusals()),
        "heavy_answers": heavy.answers(), "heavy_refused": dict(heavy.refusals()),
    }


async def shares(urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    sides = [Side(name, args.share_clients, args.heavy_tokens) for name in ("heavy", "light")]
    limits = httpx.Limits(max_connections=2 * args.share_clients + 8)
    windows: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        deadline = time.perf_counter() + args.duration
        runs = asyncio.gather(*(run_side(urls[i % len(urls)], side, KEYS[side.name], deadline, http)
                                for i, side in enumerate(sides)))
        before = await asyncio.to_thread(tenant_tokens, urls, KEYS["heavy"])
        first = before
        for _ in range(int(args.duration // args.window)):
            await asyncio.sleep(args.window)
            now = await asyncio.to_thread(tenant_tokens, urls, KEYS["heavy"])
            windows.append({t: now.get(t, 0.0) - before.get(t, 0.0) for t in now})
            before = now
        await runs
    total = {t: before.get(t, 0.0) - first.get(t, 0.0) for t in before}

    def light_share(served: dict[str, float]) -> float | None:
        whole = served.get("t:heavy", 0.0) + served.get("t:light", 0.0)
        return round(100 * served.get("t:light", 0.0) / whole, 1) if whole else None

    return {"light_share_pct_by_window": [light_share(w) for w in windows], "light_share_pct": light_share(total),
            "answers": {s.name: s.answers() for s in sides}, "refused": {s.name: dict(s.refusals()) for s in sides}}


async def probes(url: str, n: int, max_tokens: int, http: httpx.AsyncClient) -> list[RequestRecord]:
    """`n` interactive requests of the light key, one at a time, half a second apart."""
    client = InferClient(url, Sampling(max_tokens=max_tokens, ignore_eos=True), timeout=120,
                         headers={"authorization": f"Bearer {KEYS['light']}"})
    records = []
    for i in range(n):
        records.append(await client.send(http, WorkItem(index=i, prompt=PROMPTS[i % len(PROMPTS)], seed=i)))
        await asyncio.sleep(0.5)
    return records


async def preempt(urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """The light key's probes on the idle pool, then while the heavy key's clients hold every sequence."""
    heavy = Side("heavy", args.batch_clients, args.batch_tokens)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.batch_clients + 8)) as http:
        idle = await probes(urls[-1], args.probes, args.light_tokens, http)
        deadline = time.perf_counter() + args.duration
        batch = asyncio.create_task(run_side(urls[0], heavy, KEYS["heavy"], deadline, http))
        await asyncio.sleep(args.settle)  # every sequence taken
        busy = await probes(urls[-1], args.probes, args.light_tokens, http)
        await batch
    gaps = sorted(gap for r in heavy.records if r.ok for gap in r.itl)
    step = gaps[len(gaps) // 2] if gaps else 0.0

    def ms(records: list[RequestRecord]) -> list[float | None]:
        return [round(1000 * r.ttft) if r.ok and r.ttft is not None else None for r in records]

    idle_ms = sorted(t for t in ms(idle) if t is not None)
    idle_p50 = idle_ms[len(idle_ms) // 2] if idle_ms else None
    return {"idle_ttft_ms": ms(idle), "busy_ttft_ms": ms(busy), "idle_ttft_p50_ms": idle_p50,
            "step_ms": round(1000 * step, 1),
            "target_ms": round(2 * idle_p50 + 1000 * step) if idle_p50 is not None else None,
            "light_refused": dict(Side("light", 1, 0, busy).refusals()),
            "batch_answers": heavy.answers(), "batch_refused": dict(heavy.refusals())}


SCENARIOS = {"flood": flood, "shares": shares, "preempt": preempt}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--scenario", choices=tuple(SCENARIOS), default="flood")
    p.add_argument("--fair", choices=("on", "off", "both"), default="both")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-sessions", type=int, default=16, help="sequences per worker")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads per worker (start.sh's default)")
    p.add_argument("--coordinators", type=int, default=1)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of the flood, or of the shared run")
    p.add_argument("--alone", type=float, default=10.0, help="flood: seconds the light key runs alone first")
    p.add_argument("--heavy-clients", type=int, default=96)
    p.add_argument("--heavy-tokens", type=int, default=64)
    p.add_argument("--light-clients", type=int, default=2)
    p.add_argument("--light-tokens", type=int, default=16)
    p.add_argument("--share-clients", type=int, default=48, help="shares: clients per key")
    p.add_argument("--weights", default="1,1", help="the heavy and light tenants' weights")
    p.add_argument("--window", type=float, default=20.0, help="shares: seconds per window")
    p.add_argument("--probes", type=int, default=10, help="preempt: interactive requests, idle and busy")
    p.add_argument("--batch-clients", type=int, default=32, help="preempt: the heavy key's clients")
    p.add_argument("--batch-tokens", type=int, default=256, help="preempt: tokens a batch answer")
    p.add_argument("--settle", type=float, default=5.0, help="preempt: seconds before the busy probes")
    args = p.parse_args(argv)
    if args.scenario == "preempt":
        args.duration = max(args.duration, args.settle + args.probes * 3.0)
    heavy_weight, light_weight = (float(w) for w in args.weights.split(","))
    keys = f"{KEYS['heavy']} heavy {heavy_weight:g},{KEYS['light']} light {light_weight:g}"
    model = args.model or DEFAULT_MODEL_PATH
    worker = ["--model-path", str(model), "--threads", str(args.threads), "--max-sessions", str(args.max_sessions)]
    print(f"code: {code_version()}; {args.workers} workers x {args.max_sessions} sequences, {args.threads} "
          f"thread(s) each; {args.coordinators} coordinator(s); scenario {args.scenario}; weights "
          f"heavy {heavy_weight:g} light {light_weight:g}", flush=True)
    runs = [(fair, keys) for fair in (("on", "off") if args.fair == "both" else (args.fair,))]
    if args.scenario == "preempt":  # the heavy key's requests in the batch class, then in the interactive one
        runs = [("on", keys.replace(" heavy ", " heavy priority=batch ", 1).replace(
                    f"heavy {heavy_weight:g}", f"heavy {heavy_weight:g} priority=batch", 1)), ("on", keys)]
    for fair, api_keys in runs:
        flags = ["--fair-share", "true" if fair == "on" else "false"]
        with tempfile.TemporaryDirectory() as logs, pool(Path(logs), workers=[worker] * args.workers,
                                                          coordinator=flags, api_keys=api_keys, timeout=180,
                                                          coordinators=args.coordinators) as running:
            urls = running.urls or (running.url,)
            result = asyncio.run(SCENARIOS[args.scenario](urls, args))
        label = ("heavy key batch" if "priority=batch" in api_keys else "heavy key interactive") \
            if args.scenario == "preempt" else f"fair shares {fair}"
        print(f"{label}: {result}", flush=True)
        if args.scenario == "flood" and result["light_ttft_p99_ms"] and result["light_ttft_p99_alone_ms"]:
            ratio = result["light_ttft_p99_ms"] / result["light_ttft_p99_alone_ms"]
            print(f"  light TTFT p99 under the flood / alone: {ratio:.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
