"""CPU per streamed chunk of the coordinator's client to workers: aiohttp (what it uses) against httpx.

A loopback server in the same process streams `--events` SSE token events, one HTTP chunk each and
one write per event, to one streaming POST; the client reads them as they come. Prints the process's
CPU time per event for each client (server included, the same for both) and the ratio. Runs on
uvloop, as the coordinator does; `--asyncio` uses asyncio's own loop.

    .venv/bin/python -m bench.upstream_bench
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import uvloop

EVENT = b'event: token\r\ndata: {"token":" fox","index":1,"probability":0.5,"finished":false}\r\n\r\n'
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


def server(events: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(events):
            writer.write(CHUNK)
            await writer.drain()
            await asyncio.sleep(0)  # one event per loop turn, as tokens arrive one by one
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


async def read_httpx(url: str) -> int:
    reads = 0
    async with httpx.AsyncClient(trust_env=False) as client, client.stream("POST", url, content=b"{}") as response:
        async for _ in response.aiter_raw():
            reads += 1
    return reads


async def read_aiohttp(url: str) -> int:
    reads = 0
    async with aiohttp.ClientSession() as session, session.post(url, data=b"{}") as response:
        while await response.content.readany():
            reads += 1
    return reads


async def measure(name: str, read: Callable[[str], Awaitable[int]], events: int) -> float:
    listener = await asyncio.start_server(server(events), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        started = time.process_time()
        reads = await read(f"http://127.0.0.1:{port}/worker/generate")
        per_event = (time.process_time() - started) / events * 1e6
    finally:
        listener.close()
    print(f"{name:8} {events} events in {reads} reads: {per_event:.1f} us of CPU per event (server included)")
    return per_event


async def run(events: int, repeats: int) -> None:
    results: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    for _ in range(repeats):  # interleaved, so a noisy neighbour hits both
        results["httpx"].append(await measure("httpx", read_httpx, events))
        results["aiohttp"].append(await measure("aiohttp", read_aiohttp, events))
    best = {name: min(values) for name, values in results.items()}
    print(f"best of {repeats}: httpx {best['httpx']:.1f} us, aiohttp {best['aiohttp']:.1f} us per event; "
          f"aiohttp costs {best['aiohttp'] / best['httpx']:.2f} of httpx's CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--asyncio", action="store_true", help="asyncio's own event loop instead of uvloop")
    args = parser.parse_args(argv)
    (asyncio.run if args.asyncio else uvloop.run)(run(args.events, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
