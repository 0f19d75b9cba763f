"""Swap times (issue 37): one coordinator and one worker offering a folder of the two models the project
ships (SmolLM2-135M and Gemma 3 270M, `--model-dir`), serving one at a time. The time to the first token
of a chat to a cold model (the coordinator asks the worker to swap, the worker drains, loads, registers
again) against the same chat to the model once loaded, both ways.

Owns: the folder (links to the provisioned files), the rounds (each: SmolLM2 warm, Gemma cold, Gemma
warm, SmolLM2 cold), the table and `--out` JSON. Must not: change either service.

    .venv/bin/python -m bench.swap_bench [--rounds 3] [--threads 2] [--out FILE]

The worker runs `--threads` llama.cpp threads (2: the machine's two cores; the coordinator is idle
between requests), 2 sequences of 1,024 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH, GEMMA_MODEL, GEMMA_MODEL_PATH, provision

SMOL, GEMMA = "a-smollm2", "b-gemma"  # the files' stems: aliases of the models they hold
BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True}


def folder_worker(prefix: str, threads: int) -> tuple[Path, list[str]]:
    """A scratch folder whose `models/` links the two models the project ships (Gemma provisioned when
    missing), and the flags of a worker offering it: `threads` llama.cpp threads, 2 sequences of 1,024
    tokens, no embedding context."""
    provision(GEMMA_MODEL_PATH, GEMMA_MODEL)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    folder = work / "models"
    folder.mkdir()
    (folder / f"{SMOL}.gguf").symlink_to(DEFAULT_MODEL_PATH.resolve())
    (folder / f"{GEMMA}.gguf").symlink_to(GEMMA_MODEL_PATH.resolve())
    return work, ["--model-dir", str(folder), "--threads", str(threads), "--max-sessions", "2",
                  "--session-max-tokens", "1024", "--no-embeddings"]


def first_token(url: str, model: str) -> float:
    """Seconds from sending a streamed chat to its first content chunk."""
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "model": model}, timeout=300) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                return time.perf_counter() - started
    raise RuntimeError(f"{model}: no content in the stream")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    work, worker = folder_worker("swap-bench-", args.threads)
    times: dict[str, list[float]] = {k: [] for k in ("smollm2 loaded", "gemma cold", "gemma loaded", "smollm2 cold")}
    with pool(work, workers=[worker]) as running:
        first_token(running.url, SMOL)  # the first request of a process pays its own warm-up
        for _ in range(args.rounds):
            times["smollm2 loaded"].append(first_token(running.url, SMOL))
            times["gemma cold"].append(first_token(running.url, GEMMA))
            times["gemma loaded"].append(first_token(running.url, GEMMA))
            times["smollm2 cold"].append(first_token(running.url, SMOL))
    result: dict[str, Any] = {"rounds": args.rounds, "threads": args.threads,
                              "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
                              "all_s": {k: [round(t, 3) for t in v] for k, v in times.items()}}
    med = result["median_s"]
    result["cold_over_loaded"] = {"gemma": round(med["gemma cold"] / med["gemma loaded"], 1),
                                  "smollm2": round(med["smollm2 cold"] / med["smollm2 loaded"], 1)}
    print(f"{'first token':<16} {'median s':>9}  all")
    for key, values in times.items():
        print(f"{key:<16} {med[key]:>9.3f}  {', '.join(f'{t:.3f}' for t in values)}")
    print("cold / loaded:", result["cold_over_loaded"])
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
