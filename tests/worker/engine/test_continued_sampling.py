"""A continuation's sampling state (`RequestSampling(..., generated=...)`, `replay`): a request continued after
k tokens samples exactly what it would have sampled uninterrupted, seeded or greedy, with penalties and with a
grammar; a seeded request's draws are a pure function of (seed, position, draw)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.sampling import RequestSampling, SamplingParams, StepSampler, position_uniform, replay
from worker.errors import ConstraintError

VOCAB = 4096
PROMPT = (5, 9, 5, 17, 300, 9)


class Parity:
    """A stand-in grammar whose state is how many tokens it accepted: at an even count it allows even tokens
    only, at an odd count odd ones; every token it accepted is listed."""

    end = 0

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allows(self, token: int) -> bool:
        return token % 2 == len(self.accepted) % 2

    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        masked = out[:row.size]
        np.copyto(masked, row)
        masked[(1 - len(self.accepted) % 2)::2] = -np.inf
        return masked

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def logits(rows: int, seed: int) -> np.ndarray:
    """Rows of a few strong candidates, so penalties and the grammar change what is picked."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    for row in out:
        row[rng.choice(64, 6, replace=False)] += 6.0  # among the first 64 tokens: repeats are likely
    return out


def run(params: SamplingParams, rows: np.ndarray, *, generated: list[int] | None = None, grammar: bool = False,
        forget_grammar: bool = False) -> list[int]:
    constraint = Parity() if grammar else None
    if constraint is not None and generated and not forget_grammar:
        replay(constraint, generated)
    request = RequestSampling(params, constraint, PROMPT, generated or ())
    sampler = StepSampler(VOCAB)
    start = len(generated or ())
    return [sampler.sample(rows[i:i + 1], [request])[0][0] for i in range(start, len(rows))]


PARAMS = {
    "seeded top-k": SamplingParams(1.0, 1.0, 40, 1234),
    "seeded top-p": SamplingParams(1.2, 0.9, 0, 99),
    "seeded, penalised": SamplingParams(0.9, 0.95, 40, 7, presence_penalty=1.5, frequency_penalty=0.7,
                                        repeat_penalty=1.8, repeat_last_n=4),
    "greedy, penalised": SamplingParams(0.0, 1.0, 0, None, presence_penalty=2.0, frequency_penalty=1.0,
                                        repeat_penalty=3.0, repeat_last_n=3),
}


@pytest.mark.parametrize("grammar", [False, True])
@pytest.mark.parametrize("name", list(PARAMS))
def test_a_continuation_after_k_tokens_samples_what_the_whole_run_did(name: str, grammar: bool) -> None:
    rows = logits(24, seed=3)
    params = PARAMS[name]
    whole = run(params, rows, grammar=grammar)
    assert run(params, rows, grammar=grammar) == whole  # a seeded (or greedy) request repeats itself
    for k in (1, 5, 13, 23):
        assert run(params, rows, generated=whole[:k], grammar=grammar) == whole[k:], (name, k)


def test_the_state_a_continuation_replays_is_what_makes_it_equal() -> None:
    """Each part of the state matters: a continuation that forgot it would sample otherwise."""
    rows = logits(24, seed=3)
    for params in (PARAMS["seeded, penalised"], PARAMS["greedy, penalised"]):
        whole = run(params, rows)
        unpenalised = run(params, rows, generated=whole[:8])
        plain = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed)
        forgetful = RequestSampling(plain, None, PROMPT, whole[:8])  # no penalty state to carry
        assert unpenalised == whole[8:]
        sampler = StepSampler(VOCAB)
        assert [sampler.sample(rows[i:i + 1], [forgetful])[0][0] for i in range(8, 24)] != whole[8:]
    seeded = PARAMS["seeded top-k"]
    whole = run(seeded, rows, grammar=True)
    assert run(seeded, rows, generated=whole[:5], grammar=True, forget_grammar=True) != whole[5:]
    at_zero = RequestSampling(seeded, None, PROMPT)  # drawing from position 0 again, not from 8
    sampler = StepSampler(VOCAB)
    assert [sampler.sample(rows[i:i + 1], [at_zero])[0][0] for i in range(8, 24)] != run(seeded, rows)[8:]


def test_replay_refuses_a_token_the_grammar_does_not_allow_there() -> None:
    grammar = Parity()
    replay(grammar, [2, 7, 4])
    assert grammar.accepted == [2, 7, 4]
    with pytest.raises(ConstraintError, match=r"generated\.1: token 8 is not allowed"):
        replay(Parity(), [2, 8, 3])


def test_position_uniform_is_a_fixed_uniform_function_of_seed_position_and_draw() -> None:
    values = [position_uniform(seed, position, draw) for seed in range(4) for position in range(64)
              for draw in range(4)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)
    assert abs(float(np.mean(values)) - 0.5) < 0.03 and abs(float(np.var(values)) - 1 / 12) < 0.01
    # Pinned: every worker of one protocol version must draw alike, or a continuation would not continue.
    assert position_uniform(1234, 0, 0) == 0.323102120879034


def test_a_seeded_requests_draws_do_not_depend_on_how_many_draws_earlier_tokens_took() -> None:
    """A constrained re-pick draws twice for one token, a row drawn alone once: the next token draws the same
    either way (a numpy generator per request did not), and a step moves every row to its next position."""
    twice, once = (RequestSampling(SamplingParams(1.0, 1.0, 40, 42)) for _ in range(2))
    twice.uniform(), twice.uniform(), once.uniform()
    twice.drawn(), once.drawn()
    assert twice.uniform() == once.uniform() == position_uniform(42, 1, 0)
    rows = logits(12, seed=5)
    request = RequestSampling(SamplingParams(1.0, 1.0, 40, 42), Parity(), PROMPT)
    sampler = StepSampler(VOCAB)
    for i in range(12):
        sampler.sample(rows[i:i + 1], [request])
        assert request.position == i + 1 and request.draws == 0
    unseeded = RequestSampling(SamplingParams(1.0, 1.0, 40, None))
    assert unseeded.rng is not None and unseeded.uniform() != unseeded.uniform()  # fresh entropy, as before
