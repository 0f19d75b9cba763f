"""Coordinator benchmark: O(1) rejection latency, and the time to first token the coordinator adds.

Owns: two measurements and the table it prints.
Must not: change coordinator or worker code. Only 127.0.0.1 is used, and every process it starts is
stopped by its own pid in a `finally` block.

1. Rejection latency with 1 and with 1,000 registered workers. Every worker heartbeats a full load
   (all sequence slots taken), so each request is refused with 503 `sessions_full` by admission
   (no queue); then again with a one-place admission queue already holding a request, so each is
   refused with 503 `queue_full`.
   Measured two ways, in-process: the whole HTTP path through the ASGI app (httpx.ASGITransport, no
   sockets), and `Admission.check` alone. O(1) means the two worker counts give the same times within
   noise.
2. Added time to first token against a stub worker: a tiny asyncio HTTP server in this process that
   answers `/worker/generate` with one token and `done`, either at once or `--stub-delay-ms` after
   its headers (as a real worker does after prefill). Without llama.cpp in the way, the difference
   between calling it directly and through the coordinator is the coordinator's own cost (two more
   loopback hops, HTTP parsing, admission, scheduling, relay); the delayed row shows what waking up
   after an idle gap adds on this machine.
3. Added time to first token: one real worker (`python -m worker`, `--threads` llama.cpp threads) and
   one real coordinator (`python -m coordinator`) on loopback. The same greedy prompt is streamed
   `--samples` times straight from the worker and `--samples` times through the coordinator,
   interleaved, with keep-alive clients; TTFT is request sent to first token event read.

    .venv/bin/python -m bench.coordinator_bench [--rejections 2000] [--stub-samples 500] [--samples 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.processes import free_port, serving
from coordinator.admission.demand import Demand
from coordinator.app import create_app
from coordinator.errors import CoordinatorError
from coordinator.settings import Settings
from coordinator.upstream import WorkerResponse
from protocol.health import Heartbeat, WorkerLoad

ROOT = Path(__file__).resolve().parent.parent
FULL = WorkerLoad(sessions=16, max_sessions=16, active_streams=16, queue_depth=0, kv_used_bytes=0,
                  kv_reserved_bytes=0, kv_capacity_bytes=754_974_720, bytes_per_token=23_040,
                  session_max_tokens=2_048)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# -- 1. rejection latency -------------------------------------------------------------------------


class _ProbedOnly:
    """The 1,000 workers' network: each answers the coordinator's probe before it registers them, as
    `w{port - 10000}`; nothing else is ever sent to them (every request is refused by admission)."""

    async def get(self, url: str) -> tuple[int, bytes]:
        worker_id = f"w{int(url.rsplit(':', 1)[1].split('/')[0]) - 10_000}"
        return 200, json.dumps({"status": "ok", "worker_id": worker_id, "model": "smol"}).encode()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   read_timeout: float | None = None) -> WorkerResponse:
        raise AssertionError("admission refuses every request: no worker is called")

    async def delete(self, url: str, headers: Mapping[str, str]) -> int:
        raise AssertionError("no session is deleted")

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        raise AssertionError("no worker drains, so no session is moved")

    async def close(self) -> None:
        pass


async def rejection(workers: int, requests: int, *, queue_full: bool = False) -> dict[str, float]:
    """Without a queue every request is refused `sessions_full` by admission; with `queue_full`, a
    one-place queue already holds a waiting request, so every other one is refused `queue_full`."""
    settings = Settings(heartbeat_interval=300.0, queue_size=1 if queue_full else 0, queue_timeout=3600)
    app = create_app(settings, worker_client=_ProbedOnly())
    body = json.dumps({"prompt": "Hello there", "max_tokens": 16}).encode()
    expected = "queue_full" if queue_full else "sessions_full"
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as client:
        for i in range(workers):
            beat = Heartbeat(worker_id=f"w{i}", url=f"http://127.0.0.1:{10_000 + i}", model="smol",
                             load=FULL, timestamp=time.time())
            assert (await client.post("/coordinator/health/heartbeat", content=beat.model_dump_json())
                    ).status_code == 200
        waiting = asyncio.create_task(client.post("/coordinator/infer", content=body)) if queue_full else None
        while waiting is not None and app.state.coordinator.queue.length == 0:
            await asyncio.sleep(0.001)
        http_us = []
        for _ in range(requests // 10):  # warm-up
            await client.post("/coordinator/infer", content=body)
        for _ in range(requests):
            started = time.perf_counter()
            response = await client.post("/coordinator/infer", content=body)
            http_us.append((time.perf_counter() - started) * 1e6)
            assert response.status_code == 503 and response.json()["reason"] == expected
        admission = app.state.coordinator.admission
        demand = Demand(prompt_bytes=11, max_tokens=16)
        check_us = []
        for _ in range(requests):
            started = time.perf_counter()
            try:
                admission.check(demand, None)
            except CoordinatorError:
                pass
            check_us.append((time.perf_counter() - started) * 1e6)
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
    http_med, http_p99 = percentiles(http_us)
    check_med, check_p99 = percentiles(check_us)
    return {"workers": workers, "http_median_us": http_med, "http_p99_us": http_p99,
            "check_median_us": check_med, "check_p99_us": check_p99}


# -- 2 and 3. added time to first token -----------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STUB_BODY = (
    _chunk(b'event: token\r\ndata: {"token":"Paris","index":0,"probability":0.9,"finished":false}\r\n\r\n')
    + _chunk(b'event: done\r\ndata: {"finished":true,"finish_reason":"length","usage":{"prompt_tokens":10,'
             b'"cached_tokens":0,"completion_tokens":1,"total_tokens":11},"timings":{"queue_ms":0,"prefill_ms":0,'
             b'"ttft_ms":0,"total_ms":0,"tokens_per_second":0},"request_id":"x","worker_id":"stub",'
             b'"model":"stub"}\r\n\r\n')
    + b"0\r\n\r\n")
STUB_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"x-worker-id: stub\r\ntransfer-encoding: chunked\r\n\r\n"
             + _chunk(b'event: admitted\r\ndata: {"prompt_tokens":10}\r\n\r\n'))


_HEALTH_BODY = b'{"status":"ok","worker_id":"stub","model":"stub"}'
STUB_HEALTH = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
               + str(len(_HEALTH_BODY)).encode() + b"\r\n\r\n" + _HEALTH_BODY)


def _stub_connection(delay: float):  # type: ignore[no-untyped-def]
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"GET /worker/health"):  # the coordinator's probe before it registers us
                    writer.write(STUB_HEALTH)
                elif delay:  # like a real worker: headers at admission, the first token after prefill
                    writer.write(STUB_HEAD)
                    await writer.drain()
                    await asyncio.sleep(delay)
                    writer.write(STUB_BODY)
                else:
                    writer.write(STUB_HEAD + STUB_BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return serve


@contextmanager
def stub_worker(port: int, delay: float) -> Iterator[None]:
    """The stub runs on its own thread's event loop so the benchmark's blocking client can call it."""
    import threading

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(_stub_connection(delay), "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def added_ttft_stub(samples: int, delay: float) -> dict[str, float]:
    coordinator_port, stub_port = free_port(), free_port()
    coordinator, stub = f"http://127.0.0.1:{coordinator_port}", f"http://127.0.0.1:{stub_port}"
    body: dict[str, object] = {"prompt": "What is the capital of France?", "max_tokens": 1}
    with stub_worker(stub_port, delay), process(
            [sys.executable, "-m", "coordinator", "--port", str(coordinator_port), "--log-level", "warning",
             "--heartbeat-interval", "600"], coordinator + "/coordinator/health", "coordinator"):
        load = WorkerLoad(sessions=0, max_sessions=16, active_streams=0, queue_depth=0, kv_used_bytes=0,
                          kv_reserved_bytes=0, kv_capacity_bytes=754_974_720, bytes_per_token=23_040,
                          session_max_tokens=2_048)
        beat = Heartbeat(worker_id="stub", url=stub, model="stub", load=load, timestamp=time.time())
        httpx.post(coordinator + "/coordinator/health/heartbeat", content=beat.model_dump_json(), timeout=5)
        direct, via = [], []
        with httpx.Client(timeout=30) as direct_client, httpx.Client(timeout=30) as via_client:
            for _ in range(20):
                first_token_ms(direct_client, stub + "/worker/generate", body)
                first_token_ms(via_client, coordinator + "/coordinator/infer", body)
            for _ in range(samples):
                direct.append(first_token_ms(direct_client, stub + "/worker/generate", body))
                via.append(first_token_ms(via_client, coordinator + "/coordinator/infer", body))
    return {"direct_median_ms": statistics.median(direct), "via_median_ms": statistics.median(via),
            "added_median_ms": statistics.median(via) - statistics.median(direct), "samples": samples,
            "delay_ms": delay * 1000}



def process(argv: list[str], ready_url: str, name: str) -> contextlib.AbstractContextManager[object]:
    # Our own settings must not leak into the peers from this shell's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "HOST", "WORKER_TOKEN", "COORDINATOR_URL")}
    return serving(name, argv, ready_url, env=env, timeout=120)


def first_token_ms(client: httpx.Client, url: str, body: dict[str, object]) -> float:
    started = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith(("event: token", "event:token")):
                ttft = (time.perf_counter() - started) * 1000
                break
        else:
            raise AssertionError("no token event")
        for _ in lines:  # read to the end so the connection is reused
            pass
    return ttft


def added_ttft(samples: int, threads: int) -> dict[str, float]:
    coordinator_port, worker_port = free_port(), free_port()
    coordinator = f"http://127.0.0.1:{coordinator_port}"
    worker = f"http://127.0.0.1:{worker_port}"
    body: dict[str, object] = {"prompt": "What is the capital of France?", "max_tokens": 1, "temperature": 0}
    with process([sys.executable, "-m", "coordinator", "--port", str(coordinator_port), "--log-level", "warning"],
                 coordinator + "/coordinator/health", "coordinator"), \
            process([sys.executable, "-m", "worker", "--port", str(worker_port), "--worker-id", "bench",
                     "--coordinator-url", coordinator, "--threads", str(threads), "--heartbeat-interval", "1",
                     # Every sample prefills its prompt, as a new conversation would: the prompt
                     # cache would serve the repeated prompt from the second sample on.
                     "--no-prompt-cache", "--log-level", "warning"], worker + "/worker/health", "worker"):
        deadline = time.monotonic() + 60
        while httpx.get(coordinator + "/coordinator/health", timeout=2).json()["workers"]["alive"] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not register with the coordinator within 60 s")
            time.sleep(0.1)
        direct, via = [], []
        with httpx.Client(timeout=30) as direct_client, httpx.Client(timeout=30) as via_client:
            for _ in range(5):  # warm-up: connections, caches, the worker's first decode
                first_token_ms(direct_client, worker + "/worker/generate", body)
                first_token_ms(via_client, coordinator + "/coordinator/infer", body)
            for _ in range(samples):
                direct.append(first_token_ms(direct_client, worker + "/worker/generate", body))
                via.append(first_token_ms(via_client, coordinator + "/coordinator/infer", body))
    pairs = [v - d for d, v in zip(direct, via, strict=True)]
    return {"direct_median_ms": statistics.median(direct), "via_median_ms": statistics.median(via),
            "added_median_ms": statistics.median(via) - statistics.median(direct),
            "paired_added_median_ms": statistics.median(pairs), "samples": samples, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rejections", type=int, default=2000, help="refused requests timed per worker count")
    parser.add_argument("--workers", default="1,1000", help="registered worker counts to compare")
    parser.add_argument("--samples", type=int, default=60, help="TTFT samples per path")
    parser.add_argument("--stub-samples", type=int, default=500, help="TTFT samples per path against the stub")
    parser.add_argument("--stub-delay-ms", type=float, default=70.0,
                        help="the stub's gap between headers and first token in the second row (a real prefill)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the benchmark's worker")
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()

    for queue_full in (False, True):
        rows = [asyncio.run(rejection(int(n), args.rejections, queue_full=queue_full))
                for n in args.workers.split(",")]
        what = "503 queue_full, a full one-place queue" if queue_full else "503 sessions_full, no queue"
        print(f"Rejection latency ({what}), {args.rejections} requests each, in-process ASGI, one event loop")
        print(f"{'workers':>8} {'HTTP median':>12} {'HTTP p99':>10} {'check median':>13} {'check p99':>10}")
        for r in rows:
            print(f"{r['workers']:>8} {r['http_median_us']:>10.1f}us {r['http_p99_us']:>8.1f}us "
                  f"{r['check_median_us']:>11.2f}us {r['check_p99_us']:>8.2f}us")
        base, last = rows[0], rows[-1]
        print(f"ratio {last['workers']}/{base['workers']} workers: HTTP median "
              f"x{last['http_median_us'] / base['http_median_us']:.2f}, "
              f"check median x{last['check_median_us'] / base['check_median_us']:.2f}\n")
    if args.skip_ttft:
        return
    print(f"\nTime to first token against a stub worker (no model), {args.stub_samples} interleaved samples per path")
    print(f"{'first token':>22} {'direct':>10} {'through coordinator':>20} {'added':>9}")
    for delay in (0.0, args.stub_delay_ms / 1000):
        stub = added_ttft_stub(args.stub_samples if not delay else max(20, args.stub_samples // 4), delay)
        when = "with the headers" if not delay else f"{stub['delay_ms']:.0f} ms after headers"
        print(f"{when:>22} {stub['direct_median_ms']:>8.3f}ms {stub['via_median_ms']:>18.3f}ms "
              f"{stub['added_median_ms']:>7.3f}ms")
    t = added_ttft(args.samples, args.threads)
    print(f"\nTime to first token, {t['samples']} interleaved samples per path, greedy, max_tokens 1, "
          f"worker with {t['threads']} llama.cpp thread(s), coordinator 1 process / 1 event loop")
    print(f"  worker direct:       median {t['direct_median_ms']:.2f} ms")
    print(f"  through coordinator: median {t['via_median_ms']:.2f} ms")
    print(f"  added: {t['added_median_ms']:.2f} ms (difference of medians), "
          f"{t['paired_added_median_ms']:.2f} ms (median of paired differences); target < 2 ms")


if __name__ == "__main__":
    main()
