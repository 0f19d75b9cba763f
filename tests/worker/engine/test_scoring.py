"""worker/engine/scoring.py: a prompt's tokens scored from rows of raw logits, against a plain float64
log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.scoring import MIN_LOGPROB, PromptScores, log_normalizers


def reference(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def rows(m: int, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((m, vocab)) * 3).astype(np.float32)


def test_the_normalizer_is_each_rows_log_sum_exp() -> None:
    logits = rows(4)
    assert log_normalizers(logits) == pytest.approx([row.astype(np.float64).max() - reference(row).max()
                                                     for row in logits], abs=1e-6)


def test_chunks_fill_the_positions_after_their_rows_and_the_first_stays_unscored() -> None:
    tokens = [3, 7, 1, 9, 4]
    logits = rows(len(tokens) - 1)  # positions 0..3 predict tokens 1..4
    scores = PromptScores(tokens, k=3)
    scores.fill(logits[2:], [2, 3])  # a later chunk may come first: positions say where
    scores.fill(logits[:2], [0, 1])
    assert scores.logprobs[0] is None and scores.top[0] == []
    for p in range(1, len(tokens)):
        expected = reference(logits[p - 1])
        assert scores.logprobs[p] == pytest.approx(expected[tokens[p]], abs=1e-5)
        ids = [t for t, _ in scores.top[p]]
        assert ids == list(np.argsort(-expected, kind="stable")[:3])
        assert [v for _, v in scores.top[p]] == pytest.approx(sorted(expected, reverse=True)[:3], abs=1e-5)


def test_a_token_that_was_the_most_likely_has_exactly_the_top_value() -> None:
    logits = rows(1)
    best = int(np.argmax(logits[0]))
    scores = PromptScores([0, best], k=1)
    scores.fill(logits, [0])
    assert scores.top[1][0] == (best, scores.logprobs[1])  # equal, not merely close: a harness compares them


def test_a_ruled_out_token_reads_openais_floor_and_no_top_is_listed_without_k() -> None:
    logits = rows(1)
    logits[0, 5] = -np.inf
    scores = PromptScores([0, 5], k=0)
    scores.fill(logits, [0])
    assert scores.logprobs[1] == MIN_LOGPROB and scores.top == [[], []]
    texts, top = scores.texts(lambda t: b"\xe2" if t == 5 else b"a")
    assert texts == ["a", "\ufffd"] and top == [[], []]  # half a character reads U+FFFD
