"""Two coordinators, one pool: exact capacity through the workers' own admission (issue 20's first check).

Starts two real coordinators and two real workers (`--sessions` sequences each, 1 llama.cpp thread,
the default model) on loopback, each worker heartbeating to both. Then, for each count in `--clients`,
runs that many closed-loop clients against each coordinator at once (`python -m bench.load`, `--requests`
(3) a client, `--max-tokens` tokens each, ignoring end of text), while sampling every worker's own
`/worker/health` every 0.1 s. Prints per run: requests served of sent and errors, requests/s and TTFT
p50 and p90 per coordinator, the workers' capacity refusals each coordinator met
(`coordinator_failovers_total{reason="sessions_full"|"kv_full"}`; the clients never see them), and
the most sessions any worker held (never above its `--sessions`).

    .venv/bin/python -m bench.coordinators_load [--clients 16,20] [--sessions 16] [--max-tokens 16]

With 16 clients a coordinator, the 32 clients fill the 32 sequences; with 20, the 8 extra wait in the
coordinators' queues.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH

REFUSALS = ("sessions_full", "kv_full")


def refusals(url: str) -> float:
    """The workers' capacity refusals this coordinator met so far."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).raise_for_status().text.splitlines():
        if line.startswith("coordinator_failovers_total{") and any(f'reason="{r}"' in line for r in REFUSALS):
            total += float(line.rsplit(" ", 1)[1])
    return total


class PeakSessions:
    """The most sessions each worker's own health reported, sampled every 0.1 s on a thread."""

    def __init__(self, worker_urls: tuple[str, ...]) -> None:
        self.peak = [0] * len(worker_urls)
        self._urls = worker_urls
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            for i, url in enumerate(self._urls):
                try:
                    self.peak[i] = max(self.peak[i], httpx.get(url + "/worker/health", timeout=2).json()["load"]["sessions"])
                except (httpx.HTTPError, KeyError, TypeError):
                    pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="16,20", help="closed-loop clients per coordinator, one run each")
    parser.add_argument("--sessions", type=int, default=16, help="sequences per worker")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3, help="requests a client sends, one after another")
    args = parser.parse_args(argv)
    worker = ["--threads", "1", "--max-sessions", str(args.sessions), "--model-path", str(DEFAULT_MODEL_PATH)]
    print(f"2 coordinators, 2 workers x {args.sessions} sequences (1 llama.cpp thread each), "
          f"{args.max_tokens} tokens a request")
    with tempfile.TemporaryDirectory(prefix="coordinators-load-") as tmp, \
            pool(Path(tmp), workers=[worker, worker], coordinators=2, name="two") as running:
        for clients in (int(n) for n in args.clients.split(",")):
            before = [refusals(url) for url in running.urls]
            sampler = PeakSessions(running.worker_urls)
            outs = [Path(tmp) / f"load-{clients}-{i}.json" for i in range(len(running.urls))]
            loads = [subprocess.Popen([sys.executable, "-m", "bench.load", "--url", url, "--api", "infer",
                                       "--concurrency", str(clients), "--requests", str(args.requests * clients),
                                       "--max-tokens", str(args.max_tokens), "--ignore-eos", "--no-progress", "--out", str(out)],
                                      stdout=subprocess.DEVNULL)
                     for url, out in zip(running.urls, outs, strict=True)]
            for load in loads:
                if load.wait(timeout=900) != 0:
                    raise RuntimeError(f"a load process exited with {load.returncode}")
            peak = sampler.stop()
            summaries = [json.loads(out.read_text())["targets"]["target"][0]["summary"] for out in outs]
            met = [refusals(url) - b for url, b in zip(running.urls, before, strict=True)]
            ok, sent = sum(s["successes"] for s in summaries), sum(s["requests"] for s in summaries)
            errors = {k: v for s in summaries for k, v in (s["errors"] or {}).items()}
            rates = ", ".join(f"{s['requests_per_s']:.2f}" for s in summaries)
            p50s = ", ".join(f"{s['ttft_ms']['p50'] / 1e3:.2f} s" for s in summaries)
            p90s = ", ".join(f"{s['ttft_ms']['p90'] / 1e3:.2f} s" for s in summaries)
            print(f"{clients} + {clients} clients: {ok} of {sent} ok, errors {errors or 'none'}; requests/s {rates}; "
                  f"TTFT p50 {p50s}, p90 {p90s}; workers' refusals {', '.join(f'{m:.0f}' for m in met)}; most sessions a "
                  f"worker held {peak} (of {args.sessions})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
