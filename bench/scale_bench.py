"""Coordinator at scale: many SIMULATED workers, many concurrent streams, one coordinator process
(or `--coordinators N` processes sharing its port through SO_REUSEPORT, each with a port of its own,
port + 1 .. port + N, to which every worker heartbeats).

Starts a fresh coordinator, `--workers` simulated workers in `--worker-processes` processes
(`python -m worker.simulate`, no model, `--token-rate` tokens/s per stream), waits until all are registered, then drives
`--concurrency` closed-loop streams through `/coordinator/infer` with the load tool
(`python -m bench.load`) while sampling the coordinator's resident memory and open-stream count
once a second. Prints relayed tokens/s, errors, and the coordinator's memory per open stream
(RSS at the sample with the most open streams minus RSS when idle and registered, divided by the
open streams then), and the CPU time each of the three processes used during the load run: the
coordinator's CPU per relayed token is what one process would need per token with a core of its own.
Everything runs on 127.0.0.1 and is stopped in a `finally` block.

    .venv/bin/python -m bench.scale_bench --workers 100 --concurrency 500 --duration 25
    .venv/bin/python -m bench.scale_bench --coordinators 2 --load-processes 2 ...
    .venv/bin/python -m bench.scale_bench --workers 100 --idle 20 --duration 5 --concurrency 10   # heartbeats' cost
    .venv/bin/python -m bench.scale_bench --workers 20 --concurrency 200 --trace   # with every request traced
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.otlp_sink import OtlpSink
from bench.processes import serving


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a running process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children that have exited and been waited for
    return usage.ru_utime + usage.ru_stime


def combined(summaries: list[dict]) -> dict:  # type: ignore[type-arg]
    """The load processes' summaries as one: counts and rates add up; latency percentiles are the
    worst process's (they cannot be merged exactly from percentiles)."""
    out = dict(summaries[0])
    for key in ("successes", "requests", "tokens_per_s", "requests_per_s"):
        out[key] = sum(s[key] for s in summaries)
    out["duration_s"] = max(s["duration_s"] for s in summaries)
    errors: dict[str, int] = {}
    for s in summaries:
        for kind, n in (s["errors"] or {}).items():
            errors[kind] = errors.get(kind, 0) + n
    out["errors"] = errors
    for key in ("ttft_ms", "itl_ms"):
        out[key] = {p: max(s[key][p] for s in summaries) for p in summaries[0][key]}
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown processor"


def shares_of(total: int, parts: int) -> list[int]:
    """`total` split over `parts` as evenly as whole numbers allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def health(url: str) -> dict:
    return httpx.get(url + "/coordinator/health", timeout=2).json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--duration", type=float, default=25.0)
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument("--token-rate", type=float, default=10.0, help="simulated tokens/s per stream")
    parser.add_argument("--port", type=int, default=1437)
    parser.add_argument("--base-port", type=int, default=4401)
    parser.add_argument("--load-processes", type=int, default=1,
                        help="load-tool processes sharing --concurrency (one Python client saturates first)")
    parser.add_argument("--worker-processes", type=int, default=1,
                        help="simulated-worker processes sharing --workers (one process relays at most a core's worth)")
    parser.add_argument("--coordinators", type=int, default=1,
                        help="coordinator processes sharing --port (SO_REUSEPORT); CPU is reported per process")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="first measure the coordinators' CPU this many seconds with the workers registered "
                             "and no load (what heartbeats cost them); 0: skip")
    parser.add_argument("--max-streams", type=int, default=None,
                        help="the coordinator's MAX_STREAMS (default: its own); below --concurrency it is saturated")
    parser.add_argument("--trace", action="store_true",
                        help="the coordinators trace every request (OTEL_EXPORTER_OTLP_ENDPOINT: an OTLP sink in "
                             "this process, bench/otlp_sink.py): what tracing costs the relay")
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    py = sys.executable
    n = args.coordinators
    own_urls = [url] if n == 1 else [f"http://127.0.0.1:{args.port + i}" for i in range(1, n + 1)]

    def coordinator_argv(i: int) -> list[str]:
        argv = [py, "-m", "coordinator", "--port", str(args.port), "--log-level", "warning",
                "--heartbeat-interval", "2", "--worker-max-connections", str(2 * args.concurrency + 100),
                "--queue-size", "0"]
        if n > 1:
            argv += ["--reuse-port", "true", "--own-port", str(args.port + i)]
        if args.max_streams is not None:
            argv += ["--max-streams", str(args.max_streams)]
        return argv

    def workers_argv(first: int, count: int) -> list[str]:
        return [py, "-m", "worker.simulate", "--workers", str(count), "--base-port", str(args.base_port + first),
                "--coordinator-url", ",".join(own_urls), "--heartbeat-interval", "2", "--token-rate",
                str(args.token_rate), "--max-sessions", str(max(64, 2 * args.concurrency // args.workers))]

    splits = [(sum(shares_of(args.workers, args.worker_processes)[:i]), count)
              for i, count in enumerate(shares_of(args.workers, args.worker_processes))]
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(OtlpSink(keep=0)) if args.trace else None
        env = ({**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_BSP_SCHEDULE_DELAY": "500"}
               if sink is not None else None)
        procs = [stack.enter_context(serving(f"coordinator {i}", coordinator_argv(i), own + "/coordinator/health",
                                             timeout=60, env=env))
                 for i, own in enumerate(own_urls, start=1)]
        workers = [stack.enter_context(serving(f"simulated workers {first}+{count}", workers_argv(first, count),
                                               f"http://127.0.0.1:{args.base_port + first + count - 1}/worker/health",
                                               timeout=120))
                   for first, count in splits]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if all(health(own)["workers"]["alive"] == args.workers for own in own_urls):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the simulated workers did not all register with every coordinator within 120 s")
        time.sleep(1.0)
        idle_kib = sum(rss_kib(p.pid) for p in procs)
        if args.idle > 0:
            before_idle = [cpu_seconds(p.pid) for p in procs]
            time.sleep(args.idle)
            spent = [cpu_seconds(p.pid) - b for p, b in zip(procs, before_idle, strict=True)]
            print(f"idle, {args.workers} workers beating every 2 s: CPU seconds in {args.idle:g} s per coordinator "
                  f"{', '.join(f'{c:.2f}' for c in spent)} ({sum(spent) / len(spent) / args.idle:.1%} of a core each)")
        samples: list[tuple[int, int]] = []  # (rss KiB, open streams), summed over the coordinators
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                try:
                    samples.append((sum(rss_kib(p.pid) for p in procs),
                                    sum(health(own)["requests_running"] for own in own_urls)))
                except (httpx.HTTPError, OSError):
                    pass

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"load-{i}.json" for i in range(args.load_processes)]
            shares = shares_of(args.concurrency, args.load_processes)
            per_process_before = [cpu_seconds(p.pid) for p in procs]
            cpu_before = sum(per_process_before), sum(cpu_seconds(w.pid) for w in workers), children_cpu_seconds()
            loads = [subprocess.Popen([py, "-m", "bench.load", "--url", url, "--api", "infer", "--concurrency",
                                       str(share), "--duration", str(args.duration), "--max-tokens",
                                       str(args.max_tokens), "--request-cap", "100000", "--out", str(out)],
                                      stdout=subprocess.DEVNULL)
                     for share, out in zip(shares, outs, strict=True)]
            for load in loads:
                if load.wait(timeout=args.duration + 300) != 0:
                    raise RuntimeError(f"a load process exited with {load.returncode}")
            per_process = [cpu_seconds(p.pid) - b for p, b in zip(procs, per_process_before, strict=True)]
            cpu_after = (sum(per_process) + cpu_before[0], sum(cpu_seconds(w.pid) for w in workers),
                         children_cpu_seconds())
            summaries = [json.loads(out.read_text())["targets"]["target"][0]["summary"] for out in outs]
        stop.set()
        sampler.join()
        peak_rss, peak_streams = max(samples, key=lambda s: (s[1], s[0]))
        summary = combined(summaries)
        print(f"requests {summary['successes']}/{summary['requests']} ok, errors {summary['errors'] or 'none'}; "
              f"{summary['tokens_per_s']:.0f} tokens/s relayed, {summary['requests_per_s']:.1f} requests/s; "
              f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms (worst of the load processes), ITL p50 "
              f"{summary['itl_ms']['p50']:.0f} ms p99 {summary['itl_ms']['p99']:.0f} ms")
        # What issue 11 asks at saturation: every stream that started ends with done or error. A
        # connection that failed before any response head is a failed request, not a cut stream.
        unended = sum(n for kind, n in summary["errors"].items()
                      if kind.startswith("protocol") or (kind.startswith("transport") and "before_response" not in kind))
        unanswered = sum(n for kind, n in summary["errors"].items() if "before_response" in kind)
        print(f"streams that ended without a done or error event: {unended}; requests whose connection failed "
              f"before any response: {unanswered}; load processes {args.load_processes}; coordinator max_streams "
              f"{args.max_streams or 'default'}")
        print(f"machine: {os.cpu_count()} cores, {cpu_model()}")
        print(f"workers {args.workers} simulated in {args.worker_processes} process(es) ({args.token_rate:g} tok/s "
              f"per stream), "
              f"concurrency {args.concurrency}, coordinator: {n} process{'es' if n > 1 else ''}"
              + (f" sharing one port (CPU seconds each: {', '.join(f'{c:.1f}' for c in per_process)})" if n > 1 else ""))
        coordinator_cpu, workers_cpu, load_cpu = (after - before for before, after in zip(cpu_before, cpu_after))
        tokens = summary["tokens_per_s"] * summary["duration_s"]
        per_token_us = coordinator_cpu / max(tokens, 1) * 1e6
        print(f"CPU seconds during the run: coordinator{'s' if n > 1 else ''} {coordinator_cpu:.1f}, simulated workers "
              f"{workers_cpu:.1f}, load tool {load_cpu:.1f}; coordinator {per_token_us:.1f} us CPU per relayed token "
              f"(-> {1e6 / max(per_token_us, 1e-9):,.0f} tokens/s per process with a core of its own)")
        print(f"coordinator RSS idle {idle_kib / 1024:.1f} MiB; with {peak_streams} open streams "
              f"{peak_rss / 1024:.1f} MiB -> {(peak_rss - idle_kib) / max(peak_streams, 1):.1f} KiB per open stream")
        if sink is not None:
            time.sleep(1.0)  # the coordinators' last batch of spans (OTEL_BSP_SCHEDULE_DELAY: 5 s by default)
            print(f"tracing on: {sink.count} spans received for {summary['requests']} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
