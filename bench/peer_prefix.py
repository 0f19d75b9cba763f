"""A long prompt's prefix fetched from the worker that holds it, against prefilling it (issue 19): time
to first token on the second worker, and whether its greedy answer is the first worker's.

Owns: the workload (`--rounds` prompts of about `--tokens` tokens; each first prefilled on worker 1,
then sent to worker 2 with `prefix_peer` naming worker 1, and a cold prompt of the same length sent to
worker 2 without it), its two workers (./start.sh's defaults: 1 llama.cpp thread each, a worker token),
the table it prints and bench/results/peer_prefix.json.
Must not: change the workers' settings. Only 127.0.0.1 is used; the workers it starts are stopped by it.

Requests go to the workers directly, one at a time, timed by the client from the request to the
first token event; the coordinator's part (naming the peer, from its prefix index) is
tests/coordinator/test_prefix_peer.py's.

    .venv/bin/python -m bench.peer_prefix [--tokens 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.processes import ROOT, free_port, peer_env, serving

RESULTS = ROOT / "bench" / "results"
TOKEN = "bench-token"
TOPICS = ("harbour", "orchard", "foundry", "library", "observatory", "vineyard")


def ask(url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(time to first token, the text, the done event)."""
    started, first, text, last = time.monotonic(), None, [], {}
    with httpx.stream("POST", url + "/worker/generate", json=body, timeout=600,
                      headers={"authorization": f"Bearer {TOKEN}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if line.startswith('data: {"token"'):
                first = first or time.monotonic()
                text.append(json.loads(line[6:])["token"])
            elif line.startswith("data: "):
                last = json.loads(line[6:])
    return (first or time.monotonic()) - started, "".join(text), last


def prompt(topic: str, tokens: int) -> str:
    rules = [f"Rule {i} of the {topic}: item {i} is kept on shelf {i % 9} and checked every {i % 5 + 1} days."
             for i in range(tokens // 24 + 1)]
    return " ".join(rules) + " Which shelf holds item 3?"


def run(tokens: int, rounds: int, log_dir: Path) -> list[dict[str, Any]]:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports, start=1):
            stack.enter_context(serving(
                f"worker-{i}", [sys.executable, "-m", "worker", "--port", str(port), "--worker-id", f"w{i}",
                                "--threads", "1", "--coordinator-url", "", "--log-level", "warning"],
                urls[i - 1] + "/worker/health", log_path=log_dir / f"w{i}.log", env=peer_env(TOKEN)))
        out = []
        for r in range(rounds):
            warm, cold = prompt(TOPICS[2 * r % len(TOPICS)], tokens), prompt(TOPICS[(2 * r + 1) % len(TOPICS)], tokens)
            greedy = {"max_tokens": 16, "temperature": 0}
            _, where_text, _ = ask(urls[0], {"prompt": warm, **greedy})
            peer_ttft, peer_text, peer_done = ask(urls[1], {"prompt": warm, "prefix_peer": urls[0], **greedy})
            cold_ttft, _, cold_done = ask(urls[1], {"prompt": cold, **greedy})
            out.append({"prompt_tokens": peer_done["usage"]["prompt_tokens"],
                        "cached_from_peer": peer_done["usage"]["cached_tokens"],
                        "cold_prompt_tokens": cold_done["usage"]["prompt_tokens"],
                        "ttft_fetched_s": peer_ttft, "ttft_cold_s": cold_ttft,
                        "same_answer": peer_text == where_text})
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="prompt tokens, about")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="peer-prefix-") as tmp:
        rows = run(args.tokens, args.rounds, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (RESULTS / "peer_prefix.json").write_text(json.dumps({"when": when, "args": vars(args), "rounds": rows}, indent=1))
    print(f"{'prompt':>7} {'from peer':>9} {'TTFT fetched':>13} {'TTFT cold':>10} {'cold/fetched':>13} same answer")
    for row in rows:
        print(f"{row['prompt_tokens']:>7} {row['cached_from_peer']:>9} {row['ttft_fetched_s'] * 1e3:>10.0f} ms "
              f"{row['ttft_cold_s'] * 1e3:>7.0f} ms {row['ttft_cold_s'] / row['ttft_fetched_s']:>12.1f}x "
              f"{row['same_answer']}")
    ratio = statistics.median(r["ttft_cold_s"] / r["ttft_fetched_s"] for r in rows)
    print(f"median cold / fetched: {ratio:.1f}x; same greedy answer in {sum(r['same_answer'] for r in rows)} "
          f"of {len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
