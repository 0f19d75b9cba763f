"""bench.embedding_pairs' scoring, on vectors whose cosines are known."""

from __future__ import annotations

import math

import pytest

from bench.embedding_pairs import TRIPLES, score


def unit(angle: float) -> list[float]:
    return [math.cos(angle), math.sin(angle)]


def test_it_counts_the_triples_whose_paraphrase_is_nearer_and_the_margins() -> None:
    # Triple 1: paraphrase at 0.1 rad, unrelated at 1.0 rad (nearer); triple 2 the other way round.
    vectors = [unit(0.0), unit(0.1), unit(1.0), unit(0.0), unit(1.2), unit(0.2)]
    result = score(vectors)
    near = [math.cos(0.1), math.cos(1.2)]
    far = [math.cos(1.0), math.cos(0.2)]
    assert (result.closer, result.triples) == (1, 2)
    assert result.paraphrase == pytest.approx(sum(near) / 2) and result.unrelated == pytest.approx(sum(far) / 2)
    assert result.margin == pytest.approx((near[0] - far[0] + near[1] - far[1]) / 2)
    assert result.smallest == pytest.approx(near[1] - far[1]) and result.smallest < 0
    assert "nearer in 1 of 2" in result.line()


def test_a_tie_is_not_nearer_and_vectors_come_in_threes() -> None:
    assert score([unit(0.0), unit(0.5), unit(-0.5)]).closer == 0
    with pytest.raises(ValueError):
        score([unit(0.0), unit(0.5)])


def test_ten_triples_of_thirty_distinct_texts() -> None:
    texts = [text for triple in TRIPLES for text in triple]
    assert len(TRIPLES) == 10 and len(set(texts)) == 30
