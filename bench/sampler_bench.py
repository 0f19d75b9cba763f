"""The step sampler alone: microseconds a row for greedy and default sampling, and top-k's selection by a
threshold against a full selection, on random logits (no model).

Owns: the timing loop and the lines it prints.
Must not: change the sampler.

    .venv/bin/python -m bench.sampler_bench [--vocab 32000] [--rows 64] [--tree DIR]

`--tree DIR` imports the sampler from another checkout (a `git worktree` of an older commit), to
compare two versions in one session; the selection comparison needs a tree that has `_top_k`.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tree", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tree is not None:
        sys.path.insert(0, str(args.tree.resolve()))
    import numpy as np

    from worker.engine import sampling as s

    print(f"sampler from {Path(s.__file__).resolve().parent.parent.parent}")
    logits = (np.random.default_rng(0).standard_normal((args.rows, args.vocab)) * 3).astype(np.float32)
    sampler = s.StepSampler(args.vocab)
    for name, params in (("greedy", s.SamplingParams(0.0, 1.0, 0, None)),
                         ("default (0.8, top-k 40, top-p 0.95)", s.SamplingParams(0.8, 0.95, 40, 1)),
                         ("default, 2 end tokens banned", s.SamplingParams(0.8, 0.95, 40, 1, (0, 2)))):
        requests = [s.RequestSampling(params) for _ in range(args.rows)]

        def step(requests: list[s.RequestSampling] = requests) -> None:
            sampler.sample(logits, requests)

        seconds = min(timeit.repeat(step, number=20, repeat=3)) / 20
        print(f"  {name:<36} {seconds / args.rows * 1e6:6.1f} us a row ({args.rows} rows of {args.vocab} logits)")
    if hasattr(s, "_top_k"):
        row, none = logits[0], np.empty(0, dtype=np.intp)
        full = min(timeit.repeat(lambda: s._largest(row, 40), number=500, repeat=3)) / 500
        threshold = min(timeit.repeat(lambda: s._top_k(row, 40, none), number=500, repeat=3)) / 500
        print(f"  top-40 of one row: full selection {full * 1e6:.1f} us, by threshold {threshold * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
