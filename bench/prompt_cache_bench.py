"""The worker's prompt cache with alternating system prompts: three sequential greedy requests on one
worker alone, with system prompts A, B, A of about 600 tokens each. The third should find A's cells
left by the first (its `cached_tokens`) and reach its end far sooner.

    .venv/bin/python -m bench.prompt_cache_bench
"""

from __future__ import annotations

import json
import sys
import time

import httpx

from bench.prefix_bench import system_prompt
from bench.processes import free_port, peer_env, serving


def main() -> int:
    port = free_port()
    argv = [sys.executable, "-m", "worker", "--port", str(port), "--coordinator-url", "", "--threads", "1",
            "--max-sessions", "4", "--session-max-tokens", "1024", "--log-level", "warning"]
    with serving("worker", argv, f"http://127.0.0.1:{port}/worker/health", env=peer_env(None)):  # no token
        for i, which in enumerate((0, 1, 0)):
            body = {"messages": [{"role": "system", "content": system_prompt(which, 500)},
                                 {"role": "user", "content": "Any advice?"}], "max_tokens": 8, "temperature": 0}
            started = time.perf_counter()
            with httpx.stream("POST", f"http://127.0.0.1:{port}/worker/generate", json=body, timeout=120) as r:
                last = [line for line in r.iter_lines() if line.startswith("data:")][-1]
            usage = json.loads(last[5:])["usage"]
            print(f"request {i + 1} (system prompt {'AB'[which]}): {time.perf_counter() - started:5.2f} s to the end, "
                  f"{usage['cached_tokens']} of {usage['prompt_tokens']} prompt tokens cached")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
