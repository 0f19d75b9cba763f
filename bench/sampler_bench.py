"""The step sampler alone: microseconds a row for greedy and default sampling, and top-k's selection by a
threshold against a full selection, on random logits (no model).

Owns: the timing loop and the lines it prints.
Must not: change the sampler.

    .venv/bin/python -m bench.sampler_bench [--vocab 32000] [--rows 64] [--tree DIR] [--pieces]

`--tree DIR` imports the sampler from another checkout (a `git worktree` of an older commit), to
compare two versions in one session; the selection comparison needs a tree that has `_top_k`.
`--pieces` also times the parts of a default-sampling step (the sampler's own functions, each alone on
the same rows) and `top_k_rows` with other group counts than `TOP_K_GROUPS`; it needs this tree's sampler.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tree", type=Path, default=None)
    parser.add_argument("--pieces", action="store_true")
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
    if args.pieces:
        pieces(s, logits, sampler)
    return 0


def pieces(s: Any, logits: Any, sampler: Any) -> None:
    """Each part of a default-sampling step with 2 end tokens banned, timed alone, us a row."""
    import numpy as np

    rows, n_vocab = logits.shape
    every = np.arange(rows)
    banned = np.tile(np.array([0, 2], dtype=np.intp), (rows, 1))
    requests = [s.RequestSampling(s.SamplingParams(0.8, 0.95, 40, 1, (0, 2))) for _ in range(rows)]
    ids, kept, tops = s.top_k_rows(logits, every, 40, banned)
    g = n_vocab // s.TOP_K_GROUPS
    body = logits[:, :s.TOP_K_GROUPS * g].reshape(rows, s.TOP_K_GROUPS, g)
    exp_sum = sampler._exp_sum
    parts = (("argmax over the matrix (greedy's pass)", lambda: logits.argmax(axis=1)),
             ("  top_k_rows, all of it", lambda: s.top_k_rows(logits, every, 40, banned)),
             ("    of which the grouped maximum", lambda: body.max(axis=1)),
             ("  _draw_rows", lambda: s._draw_rows(ids, kept, requests)),
             ("probability's softmax denominator", lambda: [exp_sum(logits[i], float(tops[i])) for i in every]))
    print("  pieces of a default step (2 end tokens banned):")
    for name, piece in parts:
        print(f"    {name:<40} {_per_row(piece, rows):6.1f} us a row")
    chosen = s.TOP_K_GROUPS
    try:
        for groups in (8, 12, 16, 24, 32):
            s.TOP_K_GROUPS = groups
            name = f"top_k_rows with {groups} groups{' (the default)' if groups == chosen else ''}"
            print(f"    {name:<40} {_per_row(lambda: s.top_k_rows(logits, every, 40, banned), rows):6.1f} us a row")
    finally:
        s.TOP_K_GROUPS = chosen


def _per_row(step: Callable[[], object], rows: int) -> float:
    return min(timeit.repeat(step, number=20, repeat=5)) / 20 / rows * 1e6


if __name__ == "__main__":
    sys.exit(main())
