"""Named routing policies side by side: requests/s, TTFT p50/p99 and the spread of load over workers.

Per policy (`--routing-policy`), starts a real coordinator and two real workers (SmolLM2, 1 llama.cpp
thread, 16 sequences each; the `./start.sh` defaults), then runs two workloads with the project's
load tool (`bench.load`, its own process):
  40users  40 closed-loop users, max_tokens 10 (the original system's workload)
  mixed    16 closed-loop users, half short prompts and half long ones (about 600 tokens), max_tokens 24
Spread is the share of finished requests each worker served (from the workers' own metrics).

    .venv/bin/python -m bench.policy_bench [--duration 30] [--policies score,round-robin,...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from bench.load.report import read_json
from bench.processes import pool
from bench.worker_token import auth_headers
from worker.provision import DEFAULT_MODEL_PATH

POLICIES = "score,round-robin,least-connections,random,least-latency"
LONG = "Here is a long story about the sea, the ships and the lighthouse keeper who watched them. " * 30
WORKLOADS = {
    "40users": ["--concurrency", "40", "--max-tokens", "10"],
    "mixed": ["--concurrency", "16", "--max-tokens", "24", "--prompt", "Name a colour.", "--prompt",
              "Say hello.", "--prompt", LONG + "What is it about?", "--prompt", LONG + "Who is in it?"],
}


def finished(worker_url: str, worker_token: str) -> float:
    response = httpx.get(worker_url + "/metrics", headers=auth_headers(worker_token), timeout=5)
    text = response.raise_for_status().text
    return sum(float(m.group(1)) for m in re.finditer(r"^worker_requests_finished_total\{[^}]*\} (\S+)", text, re.MULTILINE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per workload and policy")
    parser.add_argument("--policies", default=POLICIES)
    args = parser.parse_args(argv)
    print(f"2 workers x 1 llama.cpp thread x 16 sequences; {args.duration:g} s per point; seeded sampling")
    print(f"{'policy':>18} {'workload':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'errors':>7}  spread")
    with tempfile.TemporaryDirectory(prefix="policy-bench-") as tmp:
        for policy in args.policies.split(","):
            worker = ["--threads", "1", "--model-path", str(DEFAULT_MODEL_PATH)]
            with pool(Path(tmp), workers=[worker, worker], coordinator=["--routing-policy", policy],
                      name=policy) as running:
                for name, extra in WORKLOADS.items():
                    before = [finished(w, running.worker_token) for w in running.worker_urls]
                    out = Path(tmp) / f"{policy}-{name}.json"
                    subprocess.run([sys.executable, "-m", "bench.load", "--url", running.url, "--api", "infer",
                                    "--duration", str(args.duration), "--ignore-eos", "--seed", "1",
                                    "--warmup", "2", "--no-progress", "--out", str(out), *extra],
                                   check=True, stdout=subprocess.DEVNULL)
                    served = [finished(w, running.worker_token) - b
                              for w, b in zip(running.worker_urls, before, strict=True)]
                    s = read_json(out)[next(iter(read_json(out)))][0].summary
                    spread = " / ".join(f"{n / max(1.0, sum(served)):.0%}" for n in served)
                    print(f"{policy:>18} {name:>9} {s.requests_per_s:7.2f} {s.ttft_ms.p50 or 0:8.0f}ms "
                          f"{s.ttft_ms.p99 or 0:8.0f}ms {s.failures:7d}  {spread}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
