"""The step sampler against llama.cpp's own sampler chain on the same logits (no model needed)."""

from __future__ import annotations

import ctypes
import itertools
import math
from pathlib import Path

import llama_cpp as ll
import numpy as np
import pytest

from worker.engine.sampling import (
    RequestSampling,
    SamplingParams,
    StepSampler,
    choice_seed,
    ggml_exp_sum,
    numpy_exp_sum,
    top_alternatives,
)

VOCAB = 49152  # SmolLM2's vocabulary: the size the worker really samples from
BANNED = (0, 2, 4)
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)


def chain_apply(row: np.ndarray, *stages: ll.llama_sampler_p) -> tuple[np.ndarray, int]:
    """Runs llama.cpp's chain of `stages` over `row` (as `llama_sampler_sample` does); returns the
    candidates left (their id, logit, p) and the selected index (-1: none)."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    for stage in stages:
        ll.llama_sampler_chain_add(chain, stage)
    data = np.zeros(row.size, dtype=TOKEN_DATA)
    data["id"] = np.arange(row.size)
    data["logit"] = row
    array = ll.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                      size=row.size, selected=-1, sorted=False)
    try:
        ll.llama_sampler_apply(chain, ctypes.byref(array))
        # Some samplers move `data` to storage of their own: read what the struct points at now.
        left = np.ctypeslib.as_array(ctypes.cast(array.data, ctypes.POINTER(ctypes.c_byte)),
                                     shape=(array.size * TOKEN_DATA.itemsize,)).view(TOKEN_DATA).copy()
        return left, int(array.selected)
    finally:
        ll.llama_sampler_free(chain)


def ban(tokens: tuple[int, ...]) -> list[ll.llama_sampler_p]:
    if not tokens:
        return []
    bias = (ll.llama_logit_bias * len(tokens))(*(ll.llama_logit_bias(t, -math.inf) for t in tokens))
    return [ll.llama_sampler_init_logit_bias(VOCAB, len(tokens), bias)]


def logits_matrix(rows: int, seed: int, *, ties: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if ties:  # few distinct values, so the largest one occurs many times per row
        return rng.integers(-20, 8, size=(rows, VOCAB)).astype(np.float32)
    return (rng.standard_normal((rows, VOCAB)) * 4).astype(np.float32)


def greedy(banned: tuple[int, ...] = ()) -> RequestSampling:
    return RequestSampling(SamplingParams(0.0, 1.0, 0, None, banned))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("banned", [(), BANNED])
def test_greedy_picks_llama_cpp_greedy_token(ties: bool, banned: tuple[int, ...]) -> None:
    logits = logits_matrix(8, seed=1, ties=ties)
    if banned:
        logits[:4, banned[1]] = logits.max() + 1.0  # rows whose largest logit is a banned token
    picks = StepSampler(VOCAB).sample(logits, [greedy(banned) for _ in range(len(logits))])
    for row, (token, _) in zip(logits, picks, strict=True):
        left, selected = chain_apply(row, *ban(banned), ll.llama_sampler_init_greedy())
        assert token == left["id"][selected]


@pytest.mark.parametrize("exp_sum", ["ggml", "numpy"])
def test_probability_is_llama_cpp_softmax_of_the_raw_logits(exp_sum: str) -> None:
    logits = logits_matrix(6, seed=2)
    logits[0] *= 4  # a peaked row as well as flat ones
    logits[4, BANNED[0]] = logits[4].max() + 2  # a row drawn side by side whose largest logit is banned
    requests = [greedy(), greedy(BANNED), RequestSampling(SamplingParams(0.7, 0.9, 40, 5)),
                RequestSampling(SamplingParams(1.3, 1.0, 0, 6, BANNED)),
                RequestSampling(SamplingParams(2.0, 1.0, 40, 8, BANNED)), greedy()]
    kernel = ggml_exp_sum() if exp_sum == "ggml" else numpy_exp_sum
    assert kernel is not None, "llama-cpp-python's ggml CPU library exports ggml_vec_soft_max_f32"
    picks = StepSampler(VOCAB, kernel).sample(logits, requests)
    for row, (token, probability) in zip(logits, picks, strict=True):
        left, _ = chain_apply(row, ll.llama_sampler_init_dist(1))  # the dist stage softmaxes every token
        p_of = dict(zip(left["id"].tolist(), left["p"].tolist(), strict=True))
        assert probability == pytest.approx(p_of[token], abs=1e-5)


def test_a_request_that_does_not_ask_for_probabilities_gets_the_same_tokens_without_them() -> None:
    from worker.engine.sampling import NOT_COMPUTED

    logits = logits_matrix(4, seed=4)

    def requests(probability: bool) -> list[RequestSampling]:
        return [RequestSampling(SamplingParams(0.0, 1.0, 0, None, BANNED, probability)),
                RequestSampling(SamplingParams(0.9, 0.9, 40, 11, (), probability))] * 2

    calls: list[int] = []

    def counting(row: np.ndarray, top: float, scratch: np.ndarray) -> float:
        calls.append(row.size)
        return numpy_exp_sum(row, top, scratch)

    with_p = StepSampler(VOCAB, counting).sample(logits, requests(True))
    assert len(calls) == 4
    without = StepSampler(VOCAB, counting).sample(logits, requests(False))
    assert len(calls) == 4  # no softmax over the vocabulary for them
    assert [t for t, _ in without] == [t for t, _ in with_p]
    assert all(math.isnan(p) for _, p in without) and math.isnan(NOT_COMPUTED)


@pytest.mark.parametrize(("top_k", "top_p", "banned"), [
    (40, 1.0, ()), (40, 0.9, ()), (0, 0.9, ()), (0, 0.5, BANNED), (5, 0.3, BANNED), (1, 0.95, ()),
    (0, 0.999, ()),  # a nucleus larger than the first guess of 64 tokens
])
def test_top_k_top_p_support_is_llama_cpp_s(top_k: int, top_p: float, banned: tuple[int, ...]) -> None:
    from worker.engine.sampling import support

    logits = logits_matrix(4, seed=3)
    logits[0] *= 3
    for row in logits:
        stages = ban(banned)
        if top_k > 0:
            stages.append(ll.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            stages.append(ll.llama_sampler_init_top_p(top_p, 1))
        left, _ = chain_apply(row, *stages)
        expected = set(left["id"][np.isfinite(left["logit"])].tolist())
        ids, _ = support(row, top_k, top_p, banned=np.array(banned, dtype=np.intp))
        assert set(ids.tolist()) == expected


def test_draws_stay_in_the_support_and_follow_the_tempered_softmax() -> None:
    row = np.full(VOCAB, -30.0, dtype=np.float32)
    row[[10, 20, 30, 40]] = [2.0, 1.5, 1.0, 0.0]
    request = RequestSampling(SamplingParams(temperature=0.5, top_p=1.0, top_k=3, seed=7))
    sampler = StepSampler(VOCAB)
    counts: dict[int, int] = {}
    for _ in range(3000):
        token, _ = sampler.sample(row[None, :], [request])[0]
        counts[token] = counts.get(token, 0) + 1
    assert set(counts) <= {10, 20, 30}  # top-k 3 cuts token 40
    weights = np.exp(np.array([2.0, 1.5, 1.0]) / 0.5)
    expected = weights / weights.sum()  # temperature applied: 0.67, 0.24, 0.09
    for token, share in zip((10, 20, 30), expected, strict=True):
        assert counts.get(token, 0) / 3000 == pytest.approx(share, abs=0.03)


def test_a_seeded_request_repeats_itself_and_seeds_differ() -> None:
    logits = logits_matrix(64, seed=4)

    def run(seed: int) -> list[int]:
        request = RequestSampling(SamplingParams(1.0, 0.95, 0, seed))
        sampler = StepSampler(VOCAB)
        return [sampler.sample(logits[i:i + 1], [request])[0][0] for i in range(len(logits))]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_rows_do_not_share_a_generator() -> None:
    """A seeded request draws the same tokens whether or not other requests sample in the same steps."""
    logits = logits_matrix(32, seed=5)
    sampler = StepSampler(VOCAB)
    alone = RequestSampling(SamplingParams(1.0, 1.0, 0, 3))
    solo = [sampler.sample(logits[i:i + 1], [alone])[0][0] for i in range(len(logits))]
    seeded = RequestSampling(SamplingParams(1.0, 1.0, 0, 3))
    other = RequestSampling(SamplingParams(1.0, 1.0, 0, 99))
    paired = [sampler.sample(np.stack([logits[i], logits[i]]), [other, seeded])[1][0] for i in range(len(logits))]
    assert paired == solo


def test_the_ggml_kernel_is_used_only_where_it_is_found(tmp_path: Path) -> None:
    assert ggml_exp_sum(tmp_path) is None  # no library there: numpy stands in
    kernel = ggml_exp_sum()
    assert kernel is not None
    rows = logits_matrix(3, seed=9)
    scratch = np.empty(VOCAB, dtype=np.float32)
    for row in [*rows, rows[:, ::2][0]]:  # a strided row takes numpy's path inside the kernel's wrapper
        top = float(row.max())
        expected = float(np.exp(row.astype(np.float64) - top).sum())
        assert kernel(row, top, scratch) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("shape", ["gaussian", "peaked", "banned_on_top", "small_vocab", "mostly_minus_inf"])
def test_top_k_by_threshold_is_the_exact_top_k(shape: str) -> None:
    """`_top_k` passes over the row once by a threshold from a strided sample; it must keep exactly the
    k largest allowed tokens, in order, whatever the row looks like."""
    from worker.engine.sampling import _top_k

    rng = np.random.default_rng(9)
    for trial in range(40):
        size = 50 if shape == "small_vocab" else VOCAB
        row = (rng.standard_normal(size) * (12 if shape == "peaked" else 3)).astype(np.float32)
        banned = np.array(sorted(rng.choice(size, 3, replace=False)), dtype=np.intp)
        if shape == "banned_on_top":
            row[banned] = row.max() + 1 + np.arange(3)
        if shape == "mostly_minus_inf":
            row[rng.random(size) < 0.99] = -np.inf
        k = int(rng.integers(1, 48))
        order = np.lexsort((np.arange(size), -row))
        expected = order[~np.isin(order, banned)][:k]
        got = _top_k(row, k, banned)
        assert got.tolist() == expected.tolist(), (trial, k)


@pytest.mark.parametrize("shape", ["gaussian", "peaked", "odd_vocab", "ties", "banned_on_top"])
def test_top_k_rows_is_the_exact_top_k_of_every_row(shape: str) -> None:
    """`top_k_rows` selects among the tokens of the groups with the largest maxima; it must keep exactly
    the k largest allowed tokens of each row, in order (ties: lower token id first; -0.0 ties 0.0), and
    give each row's largest logit."""
    from worker.engine.sampling import top_k_rows

    rng = np.random.default_rng(13)
    size = VOCAB + 11 if shape == "odd_vocab" else VOCAB  # 11 tokens past the last whole group
    logits = (rng.standard_normal((24, size)) * (12 if shape == "peaked" else 3)).astype(np.float32)
    if shape == "odd_vocab":
        logits[::2, -3] = logits.max() + 1  # the largest token of every other row is in the tail
    if shape == "ties":
        logits = rng.integers(-40, 1, size=(24, size)).astype(np.float32)  # 0 the largest, a thousand times
        logits[(logits == 0) & (rng.random(logits.shape) < 0.5)] = -0.0  # equal to 0.0, other bits
    rows = np.array([1, 4, 5, 9, 17, 23], dtype=np.intp)
    banned = np.full((rows.size, 3), -1, dtype=np.intp)  # rows ban 0 to 3 tokens, -1 pads
    if shape == "banned_on_top":
        for n, (line, r) in enumerate(zip(banned, rows, strict=True)):
            line[:n % 4] = np.argsort(-logits[r])[[0, 2, 5][:n % 4]]
    for k in (1, 7, 40, 64):
        ids, kept, tops = top_k_rows(logits, rows, k, banned if shape == "banned_on_top" else None)
        assert tops.tolist() == logits[rows].max(axis=1).tolist()
        for got_ids, got_kept, r, line in zip(ids, kept, rows, banned, strict=True):
            order = np.lexsort((np.arange(size), -logits[r]))
            expected = order[~np.isin(order, line)][:k]
            assert got_kept.tolist() == logits[r][expected].tolist(), (shape, k, r)
            if shape == "ties":  # which of the tied tokens are kept is free; their order is not
                assert got_ids.tolist() == sorted(got_ids.tolist()), (shape, k, r)
            else:
                assert got_ids.tolist() == expected.tolist(), (shape, k, r)


def test_rows_drawn_side_by_side_draw_what_each_row_draws_alone() -> None:
    """The step draws its top-k rows together (`StepSampler._draw_side_by_side`); each must draw the
    token that the same draws give from its row alone (`StepSampler._draw`), -inf rows included."""
    logits = logits_matrix(16, seed=21)
    logits[3] = -np.inf
    logits[3, [7, 700, 7000]] = [1.0, 2.0, 3.0]  # fewer finite tokens than k: drawn alone
    sampler = StepSampler(VOCAB)
    logits[5, list(BANNED)] = logits[5].max() + 1  # banned, and otherwise the likeliest
    for temperature, top_p, top_k in ((0.8, 0.95, 40), (1.0, 1.0, 40), (1.3, 0.5, 5), (0.7, 0.99, 1)):
        params = [SamplingParams(temperature, top_p, top_k, seed, BANNED if seed % 2 else ()) for seed in range(16)]
        together = [RequestSampling(p) for p in params]
        alone = [RequestSampling(p) for p in params]
        for _ in range(4):
            drawn = [token for token, _ in sampler.sample(logits, together)]
            assert drawn == [sampler._draw(row, request) for row, request in zip(logits, alone, strict=True)]
            for request in alone:  # a step's token drawn: the next draws are the next position's
                request.drawn()


def test_each_choice_of_a_seeded_request_has_its_own_seed_and_keeps_it() -> None:
    """Choice 0 draws as a one-choice request always did; the others from seeds derived from (seed, i):
    the same on every call, different from each other and from the next seed's choice 0."""
    seeds = [choice_seed(42, i) for i in range(8)]
    assert seeds[0] == 42 and seeds == [choice_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8 and 43 not in seeds
    assert all(isinstance(s, int) and 0 <= s <= 2**32 - 2 for s in seeds)  # a valid GenerateRequest.seed
    assert choice_seed(None, 3) is None  # no seed: every choice draws from fresh entropy
    row = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)

    def draws(seed: int | None) -> list[int]:
        request = RequestSampling(SamplingParams(1.5, 1.0, 0, seed))
        sampler = StepSampler(VOCAB)
        return [sampler.sample(row[None, :], [request])[0][0] for _ in range(6)]

    assert draws(choice_seed(42, 1)) == draws(choice_seed(42, 1)) != draws(choice_seed(42, 2))


def test_top_alternatives_are_the_most_likely_tokens_with_their_log_softmax() -> None:
    row = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 4
    row[7] = -np.inf  # a token the model rules out
    found = top_alternatives(row, 20)
    shifted = row.astype(np.float64) - row.max()
    log_softmax = shifted - np.log(np.exp(shifted).sum())
    expected = np.argsort(-log_softmax, kind="stable")[:20]
    assert [t for t, _ in found] == expected.tolist()
    assert np.allclose([lp for _, lp in found], log_softmax[expected], atol=1e-5)
    assert all(a >= b for (_, a), (_, b) in itertools.pairwise(found))
    assert top_alternatives(np.array([0.0, -np.inf], dtype=np.float32), 2)[1] == (1, -9999.0)


def test_a_step_of_quick_rows_picks_what_the_per_row_path_picks() -> None:
    """Greedy rows that ask for no probability take the one-argmax path (`RequestSampling.quick`); their
    picks are the general path's, a row whose best token it bans included, and a step with one row of
    another kind goes the general way for all."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((6, VOCAB)).astype(np.float32)
    logits[2, BANNED[1]] = 50.0  # this row's best is a token it bans
    quick = [RequestSampling(SamplingParams(0.0, 1.0, 0, None, BANNED, probability=False)) for _ in range(6)]
    assert all(r.quick for r in quick)
    sampler = StepSampler(VOCAB)
    picks = sampler.sample(logits, quick)
    general = [RequestSampling(SamplingParams(0.0, 1.0, 0, None, BANNED, probability=True)) for _ in range(6)]
    assert not any(r.quick for r in general)
    assert [token for token, _ in picks] == [token for token, _ in sampler.sample(logits, general)]
    assert picks[2][0] != BANNED[1] and all(math.isnan(p) for _, p in picks)
    mixed = sampler.sample(logits, [*quick[:5], general[5]])
    assert [token for token, _ in mixed] == [token for token, _ in picks]
    assert math.isnan(mixed[0][1]) and not math.isnan(mixed[5][1])
