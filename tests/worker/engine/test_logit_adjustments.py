"""logit_bias, presence and frequency penalties: applied to the rows that ask for them, only those."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.engine.sampling import RequestSampling, SamplingParams, StepSampler

VOCAB = 500


def test_a_bias_of_minus_100_keeps_a_token_out_greedy_and_sampled() -> None:
    rng = np.random.default_rng(3)
    sampler = StepSampler(VOCAB)
    for params in (SamplingParams(0.0, 1.0, 0, None), SamplingParams(1.0, 1.0, 0, 7), SamplingParams(0.8, 0.95, 40, 8)):
        for _ in range(30):
            logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
            favourite = int(logits[0].argmax())
            logits[0, favourite] += 8  # by far the likeliest
            banned = RequestSampling(SamplingParams(**{**params.__dict__, "logit_bias": ((favourite, -100.0),)}))
            (token, _), = sampler.sample(logits, [banned])
            assert token != favourite
            (free, _), = sampler.sample(logits, [RequestSampling(params)])
            assert free == favourite or not params.greedy


def test_penalties_take_off_per_generated_token_and_rows_without_them_pay_nothing() -> None:
    row = np.zeros((1, VOCAB), dtype=np.float32)
    row[0, 10], row[0, 11], row[0, 12] = 3.0, 2.5, 1.0
    sampler = StepSampler(VOCAB)
    presence = RequestSampling(SamplingParams(0.0, 1.0, 0, None, presence_penalty=1.0))
    picks = [sampler.sample(row, [presence])[0][0] for _ in range(3)]
    assert picks == [10, 11, 10]  # 10 - 1 < 2.5; then 11 - 1 < 2.0 = 10 - 1 (ties: the lower id)
    frequency = RequestSampling(SamplingParams(0.0, 1.0, 0, None, frequency_penalty=0.4))
    assert [sampler.sample(row, [frequency])[0][0] for _ in range(4)] == [10, 10, 11, 10]
    plain = RequestSampling(SamplingParams(0.0, 1.0, 0, None))
    assert not plain.adjusted and [sampler.sample(row, [plain])[0][0] for _ in range(3)] == [10, 10, 10]
    assert plain.generated == {}  # nothing counted for a row without a penalty


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path) as running:
        yield running


@pytest.mark.model
def test_a_token_biased_minus_100_stays_out_of_sampled_answers(worker: RunningWorker) -> None:
    model = worker.runtime.gate.model
    (paris,) = model.tokenize(" Paris", add_special=False)
    ask = {"messages": [{"role": "user", "content": "What is the capital of France? One word."}], "max_tokens": 12}
    greedy = generate(worker.url, {**ask, "temperature": 0})
    assert " Paris" in greedy.text or "Paris" in greedy.text
    for seed in range(10):
        answer = generate(worker.url, {**ask, "temperature": 1.0, "seed": seed, "logit_bias": {str(paris): -100}})
        assert all(t["token"] != " Paris" for t in answer.tokens), answer.text


@pytest.mark.model
def test_a_presence_penalty_changes_a_greedy_answer_that_repeats_itself(worker: RunningWorker) -> None:
    ask = {"messages": [{"role": "user", "content": "Write the word hello twenty times."}], "max_tokens": 24,
           "temperature": 0}
    plain = generate(worker.url, ask).text
    penalised = generate(worker.url, {**ask, "presence_penalty": 2.0}).text
    assert plain.lower().count("hello") >= 5, plain
    assert penalised != plain and penalised.lower().count("hello") < plain.lower().count("hello"), penalised
    repeated = generate(worker.url, {**ask, "repeat_penalty": 1.5}).text  # llama.cpp's way, over the last 64
    assert repeated != plain and repeated.lower().count("hello") < plain.lower().count("hello"), repeated


def test_the_repetition_penalty_is_llama_cpps_over_the_latest_tokens_prompt_included() -> None:
    """`repeat_penalty` against llama.cpp's own penalties sampler fed the same tokens: the prompt's,
    then the generated ones; only the last `repeat_last_n` count, positive logits are divided by the
    penalty and negative ones multiplied."""
    import ctypes

    import llama_cpp as ll

    rng = np.random.default_rng(11)
    row = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    prompt = [int(t) for t in rng.integers(0, VOCAB, 40)]
    generated = [int(t) for t in rng.integers(0, VOCAB, 30)]
    params = SamplingParams(0.0, 1.0, 0, None, repeat_penalty=1.3, repeat_last_n=50)
    ours = RequestSampling(params, prompt=prompt)
    for token in generated:
        ours.chose(token)
    got = ours.adjust(row, np.empty(VOCAB, dtype=np.float32)).copy()

    theirs = ll.llama_sampler_init_penalties(VOCAB, 50, 1.3, 0.0, 0.0)
    try:
        for token in prompt + generated:
            ll.llama_sampler_accept(theirs, token)
        data = np.zeros(VOCAB, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True))
        data["id"], data["logit"] = np.arange(VOCAB), row
        array = ll.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                          size=VOCAB, selected=-1, sorted=False)
        ll.llama_sampler_apply(theirs, ctypes.byref(array))
    finally:
        ll.llama_sampler_free(theirs)
    expected = np.empty(VOCAB, dtype=np.float32)
    expected[data["id"]] = data["logit"]
    assert np.array_equal(got, expected)
    changed = set(np.flatnonzero(got != row).tolist())
    assert changed and changed <= set((prompt + generated)[-50:])  # only the latest 50 tokens count
    off = RequestSampling(SamplingParams(0.0, 1.0, 0, None, repeat_penalty=1.3, repeat_last_n=0), prompt=prompt)
    assert not off.adjusted and off.recent is None
