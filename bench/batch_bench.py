"""A batch on idle capacity (issue 52): what a running Batch API job does to interactive chats, and how
much of the capacity they leave idle it uses.

Starts a real pool (`--workers` workers of `--max-sessions` sequences, the default model, a coordinator
with its batch store in a temporary BATCH_DIR) with two keys in two tenants, sends each of the users'
prompts once (a warm-up, unmeasured: the worker's prompt cache is warm for both phases), then runs two
phases of `--duration` seconds each:

- `alone`: `--users` interactive users, closed loop with `--think` seconds between requests, stream
  `POST /coordinator/infer` (`--tokens` tokens, `ignore_eos`);
- `with batch`: the same users, while a batch of `--lines` chat lines (`--batch-tokens` tokens each,
  `ignore_eos`; each line its own prompt, "Item N: " before one of the users' 8 prompts, as a real job's
  lines differ after a common head) uploaded with the other key runs through the Batch API; its lines
  answered from `--settle` seconds into the phase to its end are its rate (the job's ramp-up left out);
  at the end the batch is cancelled;
- `the batch alone`: a new batch as above, no interactive user (the batch's ceiling here).

Meanwhile every `--sample` seconds each worker's own load (`GET /worker/health`) is read: `sessions`
(sequences held, parked ones not) and `parkable` (batch requests among them). Printed: the interactive
TTFT p50 and p99 alone and with the batch, and their ratios (target: at most 1.2x), and their time per
output token after the first (a decode step shared with more sequences is slower); the sequences the
interactive users held, the share of the rest the batch held (target: at least 80%), and the batch's
lines answered a second.
`--rounds` repeats the two phases, each round printed on its own (the machine's load drifts between runs).
Usage: python -m bench.batch_bench [--workers N] [--max-sessions N] [--users N] [--duration S] [--lines N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
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

KEYS = {"interactive": "bench-interactive-key", "batch": "bench-batch-key"}


@dataclass
class Samples:
    """Each worker's sequences over a phase: held by anyone, and by batch requests."""

    max_sessions: int = 0
    held: list[int] = field(default_factory=list)  # summed over the workers, one entry a sample
    batch: list[int] = field(default_factory=list)

    def mean(self, values: list[int]) -> float:
        return sum(values) / len(values) if values else 0.0


async def sample(worker_urls: Sequence[str], every: float, deadline: float, http: httpx.AsyncClient) -> Samples:
    samples = Samples()
    while time.perf_counter() < deadline:
        loads = [(await http.get(url + "/worker/health", timeout=5)).json().get("load") for url in worker_urls]
        loads = [load for load in loads if load]
        samples.max_sessions = sum(load["max_sessions"] for load in loads)
        samples.held.append(sum(load["sessions"] for load in loads))
        samples.batch.append(sum(load.get("parkable", 0) for load in loads))
        await asyncio.sleep(every)
    return samples


async def users(url: str, args: argparse.Namespace, deadline: float, http: httpx.AsyncClient) -> list[RequestRecord]:
    client = InferClient(url, Sampling(max_tokens=args.tokens, ignore_eos=True), timeout=120,
                         headers={"authorization": f"Bearer {KEYS['interactive']}"})
    records: list[RequestRecord] = []

    async def user(u: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            item = WorkItem(index=u * 100_000 + n, prompt=PROMPTS[(u + n) % len(PROMPTS)], seed=u * 1000 + n)
            records.append(await client.send(http, item))
            n += 1
            await asyncio.sleep(args.think)

    await asyncio.gather(*(user(u) for u in range(args.users)))
    return records


def ttft_ms(records: list[RequestRecord], q: float) -> float | None:
    return quantile_ms([r.ttft for r in records if r.ok and r.ttft is not None], q)


def quantile_ms(seconds: list[float], q: float) -> float | None:
    values = sorted(seconds)
    return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 1) if values else None


async def submit(url: str, args: argparse.Namespace, http: httpx.AsyncClient) -> str:
    headers = {"authorization": f"Bearer {KEYS['batch']}"}
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"Item {i}: {PROMPTS[i % len(PROMPTS)]}"}],
                                  "max_tokens": args.batch_tokens, "ignore_eos": True, "seed": i}})
             for i in range(args.lines)]
    uploaded = await http.post(url + "/v1/files", headers=headers, data={"purpose": "batch"},
                               files={"file": ("lines.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode()))})
    uploaded.raise_for_status()
    batch = await http.post(url + "/v1/batches", headers=headers, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    batch.raise_for_status()
    return str(batch.json()["id"])


async def warm(url: str, args: argparse.Namespace) -> int:
    """Each of the users' prompts once, unmeasured, before the first phase: both phases then meet the
    worker's prompt cache as warm (without it the first phase alone paid every first prompt cold)."""
    client = InferClient(url, Sampling(max_tokens=args.tokens, ignore_eos=True), timeout=120,
                         headers={"authorization": f"Bearer {KEYS['interactive']}"})
    async with httpx.AsyncClient(timeout=None) as http:
        records = [await client.send(http, WorkItem(index=900_000 + i, prompt=prompt, seed=i))
                   for i, prompt in enumerate(PROMPTS)]
    return sum(r.ok for r in records)


BUSY = ("interactive", "both", "batch", "cut")  # worker_decode_busy_seconds_total's rows
COUNTERS = ("worker_steps_cut_total", "worker_preemptions_total", "worker_host_cache_restored_tokens_total",
            "worker_decode_steps_total", *(f'worker_decode_busy_seconds_total{{rows="{rows}"}}' for rows in BUSY))


def counters(worker_urls: Sequence[str], token: str) -> dict[str, float]:
    """The workers' own counters of what the batch's neighbours cost, and of the engine's time by what its
    steps carried (summed over the workers)."""
    found = dict.fromkeys(COUNTERS, 0.0)
    for url in worker_urls:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {token}"}, timeout=5).text
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in found:
                found[name] += float(value)
    return found


def counter_key(name: str) -> str:
    """worker_steps_cut_total -> steps_cut; worker_decode_busy_seconds_total{rows="cut"} -> busy_cut."""
    if "{" in name:
        return "busy_" + name.split('"')[1]
    return name.removeprefix("worker_").removesuffix("_total")


async def idle_until(deadline: float) -> list[RequestRecord]:
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    return []


async def phase(url: str, worker_urls: Sequence[str], args: argparse.Namespace, *, with_batch: bool,
                interactive: bool = True) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.users + 8)) as http:
        batch_id = await submit(url, args, http) if with_batch else None
        started = time.perf_counter()
        deadline = started + args.duration
        counted = (asyncio.create_task(completed_at(http, url, batch_id, started + args.settle))
                   if batch_id is not None else None)
        records, samples = await asyncio.gather(users(url, args, deadline, http) if interactive else idle_until(deadline),
                                                sample(worker_urls, args.sample, deadline, http))
        result: dict[str, Any] = {
            "answers": sum(r.ok for r in records), "refused": sum(not r.ok for r in records),
            "ttft_p50_ms": ttft_ms(records, 0.5), "ttft_p99_ms": ttft_ms(records, 0.99),
            "tpot_p50_ms": quantile_ms([r.tpot for r in records if r.ok and r.tpot is not None], 0.5),
            "sequences": samples.max_sessions, "held_mean": round(samples.mean(samples.held), 2),
            "batch_held_mean": round(samples.mean(samples.batch), 2),
            # The share of samples in which some sequence was held by an interactive request (one held and
            # not parkable: a batch request still prefilling counts too, briefly).
            "users_busy": round(sum(h > b for h, b in zip(samples.held, samples.batch, strict=True))
                                / max(1, len(samples.held)), 3)}
        if batch_id is not None:
            assert counted is not None
            headers = {"authorization": f"Bearer {KEYS['batch']}"}
            settled, at = await counted
            counts = (await http.get(f"{url}/v1/batches/{batch_id}", headers=headers)).json()["request_counts"]
            elapsed = time.perf_counter() - at
            await http.post(f"{url}/v1/batches/{batch_id}/cancel", headers=headers)
            await ended(http, f"{url}/v1/batches/{batch_id}", headers)  # the next phase starts on an idle pool
            held_by_users = samples.mean(samples.held) - samples.mean(samples.batch)
            idle = samples.max_sessions - held_by_users
            result.update(batch_completed=counts["completed"], batch_failed=counts["failed"],
                          batch_lines_per_s=round((counts["completed"] - settled) / elapsed, 2),
                          idle_used=round(samples.mean(samples.batch) / idle, 3) if idle > 0 else None)
    return result


async def completed_at(http: httpx.AsyncClient, url: str, batch_id: str, when: float) -> tuple[int, float]:
    """The batch's lines completed at `when` (perf_counter), and the moment read. Its rate is counted
    from there to the phase's end: by then lines have ended, and the lines in progress at both ends of
    the count are alike. Counted from the phase's start, the rate would charge the job's ramp-up (no
    line ends before one line's time), which costs more the longer a line takes: beside the users."""
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    headers = {"authorization": f"Bearer {KEYS['batch']}"}
    counts = (await http.get(f"{url}/v1/batches/{batch_id}", headers=headers)).json()["request_counts"]
    return int(counts["completed"]), time.perf_counter()


async def ended(http: httpx.AsyncClient, batch_url: str, headers: dict[str, str], timeout: float = 60.0) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if (await http.get(batch_url, headers=headers)).json()["status"] in ("cancelled", "completed", "failed"):
            return
        await asyncio.sleep(0.2)


def report(round_: int, alone: dict[str, Any], beside: dict[str, Any], batch_alone: dict[str, Any]) -> None:
    for q in ("p50", "p99"):
        before, after = alone[f"ttft_{q}_ms"], beside[f"ttft_{q}_ms"]
        if before and after:
            print(f"  round {round_}: interactive TTFT {q}: {before} ms alone, {after} ms with the batch: "
                  f"{after / before:.2f}x (target <= 1.2x)", flush=True)
    if beside.get("idle_used") is not None:
        print(f"  round {round_}: the batch held {beside['idle_used']:.0%} of the sequences the interactive users "
              f"left idle (target >= 80%); {beside['batch_completed']} lines answered, "
              f"{beside['batch_lines_per_s']}/s", flush=True)
    if alone.get("tpot_p50_ms") and beside.get("tpot_p50_ms"):
        print(f"  round {round_}: interactive time per token p50: {alone['tpot_p50_ms']} ms alone, "
              f"{beside['tpot_p50_ms']} ms with the batch: {beside['tpot_p50_ms'] / alone['tpot_p50_ms']:.2f}x; "
              f"answers {alone['answers']} alone, {beside['answers']} with the batch", flush=True)
    worker = beside["worker"]
    print(f"  round {round_}: beside the batch, the worker {worker}", flush=True)
    print(f"  round {round_}: the engine's time in llama_decode beside the batch, by what its steps carried: "
          + ", ".join(f"{rows} {worker['busy_' + rows]:.1f} s" for rows in BUSY)
          + f"; the users alone: {alone['worker']['busy_interactive']:.1f} s; the batch alone: "
          f"{batch_alone['worker']['busy_batch']:.1f} s", flush=True)
    if batch_alone.get("batch_lines_per_s"):
        used = beside['batch_lines_per_s'] / batch_alone['batch_lines_per_s']
        idle = 1 - alone["users_busy"]  # what the interactive-only run leaves: the idle capacity
        print(f"  round {round_}: the batch alone answered {batch_alone['batch_lines_per_s']} lines/s; beside the "
              f"users {used:.0%} of that, where the users alone held no sequence {idle:.0%} of the time: "
              f"{used / idle if idle else float('nan'):.0%} of the compute they left idle", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    for flag, kind, default, text in (
            ("--workers", int, 1, "workers"), ("--max-sessions", int, 8, "sequences per worker"),
            ("--threads", int, 1, "llama.cpp threads per worker (start.sh's default)"),
            ("--duration", float, 30.0, "seconds of each phase"), ("--users", int, 2, "interactive users, closed loop"),
            ("--think", float, 0.5, "seconds a user waits between requests"),
            ("--tokens", int, 16, "tokens an interactive answer"), ("--lines", int, 1000, "lines of the batch"),
            ("--batch-tokens", int, 32, "tokens a batch answer"),
            ("--sample", float, 0.2, "seconds between looks at the workers' load"),
            ("--settle", float, 8.0, "seconds into a phase from which the batch's lines are counted"),
            ("--rounds", int, 1, "rounds of the two phases")):
        p.add_argument(flag, type=kind, default=default, help=f"{text} ({default})")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    args = p.parse_args(argv)
    model = args.model or DEFAULT_MODEL_PATH
    worker = ["--model-path", str(model), "--threads", str(args.threads), "--max-sessions", str(args.max_sessions)]
    keys = f"{KEYS['interactive']} interactive,{KEYS['batch']} batch"
    print(f"code: {code_version()}; {args.workers} workers x {args.max_sessions} sequences, {args.threads} "
          f"thread(s) each; {args.users} interactive users ({args.tokens} tokens, {args.think:g} s think); "
          f"a batch of {args.lines} lines x {args.batch_tokens} tokens", flush=True)
    with tempfile.TemporaryDirectory() as logs, pool(Path(logs), workers=[worker] * args.workers,
                                                      coordinator=["--batch-dir", str(Path(logs) / "batches")],
                                                      api_keys=keys, timeout=180) as running:
        print(f"warm-up: {asyncio.run(warm(running.url, args))} of {len(PROMPTS)} prompts answered", flush=True)
        rounds = []
        for _ in range(args.rounds):  # alone and with the batch side by side, so the machine's load drifts less
            phases = []
            for with_batch, interactive in ((False, True), (True, True), (True, False)):
                before = counters(running.worker_urls, running.worker_token)
                result = asyncio.run(phase(running.url, running.worker_urls, args, with_batch=with_batch,
                                           interactive=interactive))
                after = counters(running.worker_urls, running.worker_token)
                result["worker"] = {counter_key(name): round(after[name] - before[name], 2) for name in COUNTERS}
                title = "interactive with the batch" if with_batch and interactive else \
                    "the batch alone" if with_batch else "interactive alone"
                print(f"{title}: {result}", flush=True)
                phases.append(result)
            alone, beside, batch_alone = phases
            rounds.append((alone, beside, batch_alone))
    for number, (alone, beside, batch_alone) in enumerate(rounds, start=1):
        report(number, alone, beside, batch_alone)
    return 0


if __name__ == "__main__":
    sys.exit(main())
