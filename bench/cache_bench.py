"""Response cache hits: time to first token of a repeated greedy request served from the cache,
against the same request computed by the worker (target: a hit under 5 ms through the coordinator).

Starts one real coordinator (`--cache-entries 1000`) and one real worker on loopback, sends one
greedy request to fill the cache, then `--samples` hits and, for comparison, `--samples` misses
(the same prompt with a different `max_tokens` each time, so each is computed). TTFT is client-side:
request sent to the first token event read, over one keep-alive connection.

    .venv/bin/python -m bench.cache_bench [--samples 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.processes import free_port, serving
from worker.provision import DEFAULT_MODEL_PATH

PROMPT = "Name three rivers of Europe."


def ttft(client: httpx.Client, url: str, body: dict) -> tuple[float, str]:  # type: ignore[type-arg]
    started = time.perf_counter()
    with client.stream("POST", url + "/coordinator/infer", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("event: token"):
                first = time.perf_counter() - started
                for _ in lines:  # read the rest: the connection is reused
                    pass
                return first, response.headers["x-worker-id"]
    raise RuntimeError(f"no token: {response.status_code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    port, wport = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp, \
            serving("coordinator", [sys.executable, "-m", "coordinator", "--port", str(port), "--heartbeat-interval",
                                    "1", "--log-level", "warning", "--cache-entries", "1000"],
                    url + "/coordinator/health", log_path=Path(tmp) / "coordinator.log"), \
            serving("worker", [sys.executable, "-m", "worker", "--port", str(wport), "--coordinator-url", url,
                               "--threads", str(args.threads), "--heartbeat-interval", "0.5", "--log-level",
                               "warning", "--model-path", str(DEFAULT_MODEL_PATH)],
                    f"http://127.0.0.1:{wport}/worker/health", log_path=Path(tmp) / "worker.log"), \
            httpx.Client(timeout=60) as client:
        while client.get(url + "/coordinator/health").json()["workers"]["alive"] < 1:
            time.sleep(0.2)
        greedy = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        assert ttft(client, url, greedy)[1] != "cache"  # fills the cache
        hits = [ttft(client, url, greedy) for _ in range(args.samples)]
        misses = [ttft(client, url, {**greedy, "max_tokens": 17 + i}) for i in range(args.samples // 4)]
    assert all(worker == "cache" for _, worker in hits) and all(worker != "cache" for _, worker in misses)
    hit_ms = statistics.median(t for t, _ in hits) * 1e3
    miss_ms = statistics.median(t for t, _ in misses) * 1e3
    print(f"coordinator + 1 worker ({args.threads} llama.cpp thread(s)); greedy, max_tokens 16")
    print(f"  cache hit  TTFT p50: {hit_ms:7.2f} ms  ({len(hits)} samples)  target < 5 ms: "
          f"{'MET' if hit_ms < 5 else 'MISSED'}")
    print(f"  computed   TTFT p50: {miss_ms:7.2f} ms  ({len(misses)} samples)")
    print(f"  ratio computed / hit: {miss_ms / hit_ms:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
