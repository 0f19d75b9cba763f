"""What one `llama_decode` costs by the rows in its batch, and what a long prompt's prefill costs by
its chunk: the measurements behind the worker's 64-token chunk (worker/engine/pacing.py).

Owns: its own llama.cpp context (the worker's shape: 16 sequences of 2,048 tokens, `--threads`
threads) and the two tables it prints. Must not: touch the worker's code.

    .venv/bin/python -m bench.step_sizes [--threads 1] [--context 768] [--prompt 1700]

Table 1: one sequence's batch of B prompt tokens at `--context` tokens of context, the median of
three. Table 2: a `--prompt`-token prompt prefilled from empty in chunks of each size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp as ll

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "modelFiles" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ROWS = (1, 4, 16, 32, 48, 63, 64, 65, 96, 128, 256)
CHUNKS = (256, 64, 32, 16)


class Context:
    def __init__(self, model_path: Path, threads: int) -> None:
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(model_path).encode(), ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_seq_max = 16 * 2048, 16
        params.n_batch = params.n_ubatch = 256 + 16
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch: Any = ll.llama_batch_init(params.n_batch, 0, 1)

    def step(self, rows: int, first_pos: int) -> float:
        """Seconds of one decode of `rows` prompt tokens of sequence 1 from `first_pos`."""
        for i in range(rows):
            self.batch.token[i], self.batch.pos[i] = 300 + (first_pos + i) % 500, first_pos + i
            self.batch.n_seq_id[i], self.batch.seq_id[i][0], self.batch.logits[i] = 1, 1, i == rows - 1
        self.batch.n_tokens = rows
        started = time.perf_counter()
        if ll.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    def clear(self, from_pos: int = -1) -> None:
        ll.llama_memory_seq_rm(self.mem, 1, from_pos, -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--prompt", type=int, default=1700)
    args = parser.parse_args(argv)
    run = Context(args.model, args.threads)
    for start in range(0, args.context, 256):
        run.step(min(256, args.context - start), start)
    print(f"one batch of B rows at {args.context} tokens of context, {args.threads} thread(s):")
    for rows in ROWS:
        times = []
        for _ in range(3):
            times.append(run.step(rows, args.context))
            run.clear(args.context)
        t = statistics.median(times)
        print(f"  B {rows:4d}: {t * 1e3:8.1f} ms a step {t / rows * 1e3:7.2f} ms a row", flush=True)
    run.clear()
    print(f"a {args.prompt}-token prompt prefilled from empty:")
    for chunk in CHUNKS:
        started, pos = time.perf_counter(), 0
        while pos < args.prompt:
            run.step(min(chunk, args.prompt - pos), pos)
            pos += chunk
        took = time.perf_counter() - started
        run.clear()
        print(f"  chunks of {chunk:3d}: {took:6.2f} s, {took / args.prompt * 1e3:5.2f} ms a token", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
