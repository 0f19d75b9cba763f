"""The seed each choice of a seeded request draws from, which both services must derive alike: a worker
samples choice i of an n-choice request from it, and a coordinator that continues choice i alone on
another worker (a one-choice request) sends it as that request's seed.

Owns: `choice_seed`. Must not: sample anything (worker/engine/sampling.py does).
"""

from __future__ import annotations

import numpy as np

SEEDS = 2**32 - 1  # a seed is 0 to 2^32 - 2: llama.cpp's 2^32 - 1 (LLAMA_DEFAULT_SEED) means "random"


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed choice `choice` of a request seeded with `seed` draws from: `seed` itself for choice 0,
    so a one-choice request draws as it always did; for the others a 32-bit seed that numpy's
    `SeedSequence` derives from (seed, choice), so a seeded request with several choices repeats
    itself choice by choice and no two of its choices share their draws. None stays None: each
    choice then draws from fresh entropy."""
    if seed is None or choice == 0:
        return seed
    return int(np.random.SeedSequence((seed, choice)).generate_state(1)[0]) % SEEDS
