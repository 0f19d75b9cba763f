"""A prompt's own tokens scored: what an evaluation harness reads from `echo` with `logprobs`.

Owns: `PromptScores`, the scores of one prompt as steps of its prefill fill them in (each step's rows
of logits score the tokens that follow their positions), and the numbers themselves: a token's
log-probability under the raw logits of the position before it (log-softmax over the whole row),
and the most likely tokens there. Pure numpy: no llama.cpp, no I/O.
Must not: decide which rows a step computes (the engine does) or format them for a client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Prompt positions one step may score for one request: each is a row of logits that llama.cpp keeps
# (n_vocab floats: 0.2 MB for SmolLM2, 1 MB for Gemma 3), so a scored prompt goes in chunks of this.
SCORE_CHUNK = 64
MIN_LOGPROB = -9999.0  # OpenAI's floor for a token the model rules out (-inf is not JSON)


def log_normalizers(rows: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp over the vocabulary (float64), for (m, n_vocab) raw logits: a token's
    log-probability is its logit minus its row's."""
    top = rows.max(axis=1, keepdims=True)
    return top[:, 0].astype(np.float64) + np.log(np.exp(rows - top, dtype=np.float64).sum(axis=1))


def _logprob(logit: float, log_z: float) -> float:
    return max(logit - log_z, MIN_LOGPROB)


def most_likely(row: np.ndarray, k: int, log_z: float) -> list[tuple[int, float]]:
    """The `k` most likely tokens of a row of raw logits, most likely first, each with its log-probability
    against the row's normalizer `log_z` (OpenAI's `top_logprobs`)."""
    k = min(k, row.shape[0])
    ids = np.argpartition(row, -k)[-k:]
    ids = ids[np.argsort(-row[ids], kind="stable")]
    return [(int(t), _logprob(float(row[t]), log_z)) for t in ids]


@dataclass(eq=False)
class PromptScores:
    """One prompt's scores, filled in as its prefill goes: position 0 has none (nothing predicts it);
    position p is scored from the logits of position p - 1."""

    tokens: list[int]
    k: int  # the most likely tokens to list at each position (0: none)
    logprobs: list[float | None] = field(init=False)
    top: list[list[tuple[int, float]]] = field(init=False)

    def __post_init__(self) -> None:
        self.logprobs = [None] * len(self.tokens)
        self.top = [[] for _ in self.tokens]

    def fill(self, rows: np.ndarray, positions: Sequence[int]) -> None:
        """Scores the tokens after `positions` from their rows of logits (row i: position positions[i]).
        A token and the most likely ones are read against the same normalizer, so a token that was the
        most likely has exactly the top value (what a harness's greedy check compares)."""
        if not positions:
            return
        log_z = log_normalizers(rows)
        for i, position in enumerate(positions):
            row, z, p = rows[i], float(log_z[i]), position + 1
            self.logprobs[p] = _logprob(float(row[self.tokens[p]]), z)
            if self.k:
                self.top[p] = most_likely(row, self.k, z)

    def texts(self, piece: Callable[[int], bytes]) -> tuple[list[str], list[list[tuple[str, float]]]]:
        """The tokens' texts and the top tokens' texts (each token decoded alone: a partial UTF-8
        character reads U+FFFD)."""
        def text(token: int) -> str:
            return piece(token).decode("utf-8", errors="replace")
        return [text(t) for t in self.tokens], [[(text(t), lp) for t, lp in row] for row in self.top]
