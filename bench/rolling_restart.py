"""A rolling restart under kept conversations: is every conversation's next turn served from its KV,
as fast as a warm turn, after its worker drained and its sessions moved (issue 19)?

Owns: the workload (N sessions with about `--history` tokens each, spread over two workers; a warm
turn of each on its undisturbed worker; then each worker in turn drained by SIGTERM and started
again, and every session's next turn after each drain), its pool (a coordinator and two workers with
./start.sh's defaults: 1 llama.cpp thread each), the table it prints and bench/results/rolling_restart.json.
Must not: change the pool's settings beyond start.sh's. Only 127.0.0.1 is used; every process it
starts is stopped by itself.

Each turn is sent alone (no other load) and timed by the client: time to first token from the
request, and the worker's `cached_tokens` against the session's history (the previous turn's
prompt and answer). A cold reference is a new session's first turn of the same length.

    .venv/bin/python -m bench.rolling_restart [--sessions 16] [--history 500]
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.processes import ROOT, free_port, peer_env, stop, wait_ready

RESULTS = ROOT / "bench" / "results"
WORDS = ("river", "mountain", "lantern", "harbor", "meadow", "copper", "violet", "engine", "garden", "thunder")


@dataclass
class Turn:
    session: str
    phase: str
    worker: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    history_tokens: int  # what the session held before this turn


class Pool:
    """A coordinator and two workers; a worker can be drained and started again on its own port."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.token = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.coordinator = self._spawn("coordinator", [sys.executable, "-m", "coordinator", "--port",
                                                       self.url.rsplit(":", 1)[1], "--log-level", "warning"])
        wait_ready(self.coordinator, self.url + "/coordinator/health", "coordinator", timeout=60)
        self.ports = {"w1": free_port(), "w2": free_port()}
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        for worker_id in self.ports:
            self.start(worker_id)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            return subprocess.Popen(argv, cwd=ROOT, env=peer_env(self.token), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def start(self, worker_id: str) -> None:
        port = self.ports[worker_id]
        self.workers[worker_id] = self._spawn(worker_id, [
            sys.executable, "-m", "worker", "--port", str(port), "--worker-id", worker_id, "--threads", "1",
            "--coordinator-url", self.url, "--log-level", "info"])
        deadline = time.monotonic() + 120
        while self.state(worker_id) != ("alive", False):  # the new process's heartbeat, not the old one's
            if time.monotonic() > deadline or self.workers[worker_id].poll() is not None:
                raise RuntimeError(f"{worker_id} did not register (log in {self.log_dir})")
            time.sleep(0.2)

    def state(self, worker_id: str) -> tuple[str, bool] | None:
        """(its state, whether it drains), as the coordinator lists it."""
        listing = httpx.get(self.url + "/coordinator/health/workers", timeout=5).json()["workers"]
        return next(((w["state"], w["draining"]) for w in listing if w["worker_id"] == worker_id), None)

    def drain(self, worker_id: str) -> float:
        """SIGTERM, then the seconds until the process exited."""
        started = time.monotonic()
        self.workers[worker_id].send_signal(signal.SIGTERM)
        self.workers[worker_id].wait(timeout=120)
        return time.monotonic() - started

    def close(self) -> None:
        for proc in [*self.workers.values(), self.coordinator]:
            stop(proc)


def turn(url: str, session: str, prompt: str, phase: str, history: int) -> Turn:
    started = time.monotonic()
    first: float | None = None
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/coordinator/infer", timeout=120, json={
            "prompt": prompt, "session_id": session, "max_tokens": 8, "temperature": 0}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{session} ({phase}): {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if line.startswith("data: "):
                first = first or time.monotonic()
                events.append(json.loads(line[6:]))
        worker = response.headers.get("x-worker-id", "")
    done = events[-1]
    if not done.get("finished") or "usage" not in done:
        raise RuntimeError(f"{session} ({phase}) did not end with done: {done}")
    usage = done["usage"]
    return Turn(session, phase, worker, (first or time.monotonic()) - started, usage["prompt_tokens"],
                usage["cached_tokens"], history)


def long_prompt(i: int, words: int) -> str:
    return " ".join(f"{WORDS[(i + k) % len(WORDS)]}{k % 7}" for k in range(words)) + f". Summarise note {i}."


def run(sessions: int, history: int, log_dir: Path) -> dict[str, Any]:
    pool = Pool(log_dir)
    turns: list[Turn] = []
    held: dict[str, int] = {}
    drains: dict[str, float] = {}
    try:
        names = [f"conv-{i}" for i in range(sessions)]
        words = max(8, history * 4 // 9)  # about 2.25 tokens a word here
        for i, name in enumerate(names):
            first = turn(pool.url, name, long_prompt(i, words), "first", 0)
            turns.append(first)
        for t in turns:
            held[t.session] = t.prompt_tokens + 8
        for name in names:  # warm: the next turn on the worker that holds it, nothing disturbed
            t = turn(pool.url, name, "Go on.", "warm", held[name])
            turns.append(t)
            held[name] = t.prompt_tokens + 8
        for worker_id in ("w1", "w2"):
            drains[worker_id] = pool.drain(worker_id)
            for name in names:
                t = turn(pool.url, name, "And then?", f"after {worker_id} drained", held[name])
                turns.append(t)
                held[name] = t.prompt_tokens + 8
            pool.start(worker_id)
        cold = [turn(pool.url, f"cold-{i}", long_prompt(100 + i, words), "cold", 0) for i in range(3)]
    finally:
        pool.close()
    return {"turns": [asdict(t) for t in turns], "cold": [asdict(t) for t in cold], "drain_seconds": drains}


def summary(result: dict[str, Any]) -> list[str]:
    turns = [Turn(**t) for t in result["turns"]]
    warm = statistics.median(t.ttft_s for t in turns if t.phase == "warm")
    cold = statistics.median(t["ttft_s"] for t in result["cold"])
    lines = [f"{'phase':<20} {'turns':>5} {'min cached/history':>19} {'TTFT median':>12} {'max':>8} {'max/warm':>9}"]
    for phase in dict.fromkeys(t.phase for t in turns if t.phase != "first"):
        rows = [t for t in turns if t.phase == phase]
        ratio = min(t.cached_tokens / t.history_tokens for t in rows)
        ttfts = [t.ttft_s for t in rows]
        lines.append(f"{phase:<20} {len(rows):>5} {ratio:>19.3f} {statistics.median(ttfts) * 1e3:>9.0f} ms "
                     f"{max(ttfts) * 1e3:>5.0f} ms {max(ttfts) / warm:>8.2f}x")
    history = statistics.median(t.history_tokens for t in turns if t.phase == "warm")
    lines.append(f"cold first turn of the same length: TTFT median {cold * 1e3:.0f} ms "
                 f"({cold / warm:.1f}x warm); history {history:.0f} tokens at the warm turn")
    lines.append("drain to exit: " + ", ".join(f"{w} {s:.1f} s" for w, s in result["drain_seconds"].items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rolling_restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--history", type=int, default=500, help="tokens of each session's first turn, about")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rolling-") as tmp:
        result = run(args.sessions, args.history, Path(tmp))
    result["when"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rolling_restart.json").write_text(json.dumps(result, indent=1))
    print("\n".join(summary(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
