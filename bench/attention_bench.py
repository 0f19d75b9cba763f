"""Flash attention on or off, in llama.cpp itself (no pool): what a prompt costs deep in a conversation, and
what a decode step of many sequences costs, so WORKER_FLASH_ATTN can be chosen by measurement.

    .venv/bin/python -m bench.attention_bench [--model GGUF] [--threads 1] [--depth 400] [--new 55]

For each setting (off, on), in one process and one context shaped as a worker's (split KV, `--sequences`
sequences of 512 cells, one batch of 512 + sequences rows): the median time of one `llama_decode` of
`--fresh` prompt tokens at position 0, of `--new` tokens after `--depth` tokens of the same sequence (a
stored chain's next turn: its history cached, its new input prefilled), and of one decode step of one
token for each of `--sequences` sequences at `--step-depths`. Prints each and the deep prefill's ratio to
the fresh one (bench/chain_bench.py's goal for the whole turn: at most 1.2x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import llama_cpp as ll

from worker.provision import DEFAULT_MODEL_PATH

SEQ_CELLS = 512
SETTINGS = {"off": 0, "on": 1}  # llama.cpp's flash_attn_type
_QUIET = ll.llama_log_callback(lambda level, text, data: None)


class Bench:
    def __init__(self, model: object, *, sequences: int, threads: int, flash_attn: int) -> None:
        params = ll.llama_context_default_params()
        params.n_ctx = SEQ_CELLS * sequences
        params.n_batch = params.n_ubatch = SEQ_CELLS + sequences
        params.n_seq_max = sequences
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = flash_attn
        params.no_perf = True
        self.sequences = sequences
        self.ctx = ll.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make the context")
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(SEQ_CELLS + sequences, 0, 1)

    def close(self) -> None:
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)

    def decode(self, rows: Sequence[tuple[int, int, int]]) -> float:
        """One llama_decode of `rows` (token, position, sequence), logits for each sequence's last; seconds."""
        batch, last = self.batch, {seq: i for i, (_, _, seq) in enumerate(rows)}
        batch.n_tokens = len(rows)
        for i, (token, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(last[seq] == i)
        started = time.perf_counter()
        if ll.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    def prompt(self, depth: int, new: int, reps: int) -> float:
        """`new` prompt tokens after `depth` already in the sequence's cells; the median seconds."""
        times = []
        for _ in range(reps):
            ll.llama_memory_clear(self.mem, True)
            if depth:
                self.decode([(100 + i % 1000, i, 0) for i in range(depth)])
            times.append(self.decode([(300 + i % 1000, depth + i, 0) for i in range(new)]))
        return statistics.median(times)

    def step(self, depth: int, steps: int) -> float:
        """One token for each sequence, each `depth` deep; the median seconds of `steps` such steps."""
        ll.llama_memory_clear(self.mem, True)
        for seq in range(self.sequences):
            self.decode([(100 + i % 1000, i, seq) for i in range(depth)])
        return statistics.median(self.decode([(200, depth + k, seq) for seq in range(self.sequences)])
                                 for k in range(steps))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--fresh", type=int, default=49, help="tokens of the fresh prompt")
    p.add_argument("--depth", type=int, default=400, help="tokens already cached before the deep prompt")
    p.add_argument("--new", type=int, default=55, help="tokens of the deep prompt")
    p.add_argument("--step-depths", default="64,300")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    ll.llama_log_set(_QUIET, None)  # llama.cpp's own lines on stderr would bury the figures
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(args.model).encode(), ll.llama_model_default_params())
    if not model:
        print(f"could not load {args.model}", file=sys.stderr)
        return 1
    depths = [int(d) for d in args.step_depths.split(",")]
    print(f"{args.model.name}, {args.threads} thread(s), split KV, {args.sequences} sequences of {SEQ_CELLS} cells")
    for name, setting in SETTINGS.items():
        bench = Bench(model, sequences=args.sequences, threads=args.threads, flash_attn=setting)
        try:
            fresh = bench.prompt(0, args.fresh, args.reps)
            deep = bench.prompt(args.depth, args.new, args.reps)
            steps = [bench.step(d, 10) for d in depths]
        finally:
            bench.close()
        step_text = ", ".join(f"at depth {d}: {1000 * s:.1f} ms" for d, s in zip(depths, steps, strict=True))
        print(f"flash attention {name:3}: {args.fresh} tokens at 0: {1000 * fresh:.0f} ms; {args.new} tokens after "
              f"{args.depth}: {1000 * deep:.0f} ms ({deep / fresh:.2f}x); a {args.sequences}-sequence decode step "
              f"{step_text}", flush=True)
    ll.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
