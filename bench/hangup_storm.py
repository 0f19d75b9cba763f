"""Clients that hang up after their first token, against a running pool: the internal refusals and
queue waits it causes, read from the coordinator's metrics.

    ./start.sh --port 1611 --worker-port 3621 &
    .venv/bin/python -m bench.hangup_storm --url http://127.0.0.1:1611 [--clients 200] [--concurrency 30]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

BODY = {"prompt": "Tell a long story about the sea.", "max_tokens": 256, "ignore_eos": True}
COUNTERS = ("coordinator_failovers_total", "coordinator_queue_outcomes_total", "coordinator_admission_decisions_total")


def counters(url: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(COUNTERS):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


async def hang_up(client: httpx.AsyncClient, url: str, slots: asyncio.Semaphore, statuses: dict[int, int]) -> None:
    async with slots, client.stream("POST", url + "/coordinator/infer", json=BODY) as response:
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        async for line in response.aiter_lines():
            if line.startswith("event: token"):
                return  # leaving the block closes the connection: the client is gone


async def run(url: str, clients: int, concurrency: int) -> None:
    before, statuses = counters(url), dict[int, int]()
    started = time.monotonic()
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(hang_up(client, url, slots, statuses) for _ in range(clients)))
    after = counters(url)
    print(f"{clients} clients, {concurrency} at once: statuses {statuses} in {time.monotonic() - started:.1f} s")
    for name in sorted(after):
        if after[name] != before.get(name, 0.0):
            print(f"  {name} +{after[name] - before.get(name, 0.0):g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=30)
    args = parser.parse_args(argv)
    asyncio.run(run(args.url.rstrip("/"), args.clients, args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
