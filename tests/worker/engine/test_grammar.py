"""Constrained decoding: the sampler with a grammar (a fake one, then llama.cpp's on the real model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from bench.agents_check import SCHEMAS
from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.engine.sampling import RequestSampling, SamplingParams, StepSampler

VOCAB = 1000


class EvenOnly:
    """Allows even tokens only; ends when told nothing may follow."""

    end = 999

    def __init__(self, *, dead: bool = False) -> None:
        self.checked: list[int] = []
        self.accepted: list[int] = []
        self.masks = 0
        self.dead = dead

    def allows(self, token: int) -> bool:
        self.checked.append(token)
        return not self.dead and token % 2 == 0

    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        self.masks += 1
        np.copyto(out[:row.size], row)
        out[1::2] = -np.inf
        if self.dead:
            out[:] = -np.inf
        return out[:row.size]

    def accept(self, token: int) -> None:
        self.accepted.append(token)


@pytest.mark.parametrize("params", [SamplingParams(0.0, 1.0, 0, None), SamplingParams(0.9, 0.95, 40, 3),
                                    SamplingParams(1.2, 1.0, 0, 4)])
def test_a_constrained_row_only_gets_what_its_grammar_allows_and_pays_only_when_it_refuses(
        params: SamplingParams) -> None:
    rng = np.random.default_rng(5)
    sampler, constraint = StepSampler(VOCAB), EvenOnly()
    free = RequestSampling(params)
    bound = RequestSampling(params, constraint)
    unbound = []
    for _ in range(50):
        logits = (rng.standard_normal((2, VOCAB)) * 3).astype(np.float32)
        (token, _), (other, _) = sampler.sample(logits, [bound, free])
        assert token % 2 == 0 and constraint.accepted[-1] == token
        unbound.append(other)
    assert any(t % 2 for t in unbound)  # the row beside it, without a grammar, is not constrained
    assert constraint.masks < len(constraint.checked) == 50  # masked only when the first pick was refused
    assert any(t % 2 for t in constraint.checked)  # (and it was, sometimes)


def test_a_grammar_that_allows_nothing_ends_the_answer_without_accepting() -> None:
    constraint = EvenOnly(dead=True)
    logits = np.random.default_rng(1).standard_normal((1, VOCAB)).astype(np.float32)
    (token, _), = StepSampler(VOCAB).sample(logits, [RequestSampling(SamplingParams(0.0, 1.0, 0, None), constraint)])
    assert token == EvenOnly.end and constraint.accepted == []


@pytest.mark.parametrize(("first", "state"), [(4, "holding"), (3, "free")])
def test_a_lazy_grammar_holds_only_an_answer_that_starts_as_it_does(first: int, state: str) -> None:
    """Whitespace first is not the start; the first other token decides: one the grammar takes wakes
    it for the rest of the answer, any other leaves the answer free (and the grammar unfed)."""
    from worker.engine.grammar import LazyGrammar

    inner = EvenOnly()
    lazy = LazyGrammar(inner, lambda token: b" " if token == 1 else b"w%d" % token)  # type: ignore[arg-type]
    sampler, rng = StepSampler(VOCAB), np.random.default_rng(2)
    request = RequestSampling(SamplingParams(0.0, 1.0, 0, None), lazy)
    row = np.zeros((1, VOCAB), dtype=np.float32)
    for token in (1, first):  # a space, then the first word
        row[:] = 0
        row[0, token] = 10
        assert sampler.sample(row, [request])[0][0] == token
    assert lazy.state == state and inner.accepted == ([first] if state == "holding" else [])
    picked = [sampler.sample((rng.standard_normal((1, VOCAB)) * 3).astype(np.float32), [request])[0][0]
              for _ in range(40)]
    if state == "holding":
        assert all(t % 2 == 0 for t in picked) and inner.accepted[1:] == picked
    else:
        assert any(t % 2 for t in picked) and inner.accepted == []


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path) as running:
        yield running


@pytest.mark.model
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_answers_constrained_by_a_json_schema_parse_and_validate(worker: RunningWorker, name: str) -> None:
    schema = SCHEMAS[name]
    stream = generate(worker.url, {"messages": [{"role": "user", "content": "Give an example as JSON."}],
                                   "max_tokens": 200, "temperature": 0, "json_schema": schema})
    assert stream.last[1]["finish_reason"] == "stop", stream.last
    jsonschema.validate(json.loads(stream.text), schema)


@pytest.mark.model
def test_a_gbnf_grammar_constrains_sampled_answers(worker: RunningWorker) -> None:
    answers = {generate(worker.url, {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8,
                                     "temperature": 1.0, "seed": seed, "grammar": 'root ::= "yes" | "no"'}).text
               for seed in range(6)}
    assert answers <= {"yes", "no"} and answers


@pytest.mark.model
@pytest.mark.parametrize(("fields", "names"), [
    ({"grammar": "root ::= oops("}, "grammar"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema"),
])
def test_an_invalid_grammar_or_schema_is_refused_naming_it(worker: RunningWorker, fields: dict, names: str) -> None:  # type: ignore[type-arg]
    stream = generate(worker.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields})
    assert stream.refusal is not None and stream.refusal["reason"] == "invalid_request"
    assert names in stream.refusal["error"]
    assert worker.load()["sessions"] == 0


@pytest.mark.model
def test_a_json_string_never_holds_a_raw_control_character(model_path: Path) -> None:
    """JSON wants a newline inside a string escaped (`\\n`); the schema's grammar must refuse the raw
    one that the model would like to write there, and still take the escape."""
    from worker.backends.llama_model import Model

    model = Model(model_path)
    try:
        grammar = model.constraint(grammar=None, json_schema={
            "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
        assert grammar is not None
        for token in model.tokenize('{"a": "x', add_special=False):
            assert grammar.allows(token)
            grammar.accept(token)
        newline, tab = model.tokenize("\n", add_special=False), model.tokenize("\t", add_special=False)
        assert len(newline) == 1 and len(tab) == 1
        assert not grammar.allows(newline[0]) and not grammar.allows(tab[0])
        assert all(grammar.allows(t) for t in model.tokenize("y", add_special=False))
        (backslash,) = model.tokenize("\\", add_special=False)
        assert grammar.allows(backslash)
        grammar.close()
    finally:
        model.close()


@pytest.mark.model
def test_a_lazy_schema_holds_an_answer_that_opens_an_object_and_leaves_prose_free(
        worker: RunningWorker, model_path: Path) -> None:
    """`grammar_lazy` (tool_choice auto): pushed to open with `{`, the answer is a valid object of the
    schema; pushed to open with a word, it is left alone (here it repeats the word: not JSON)."""
    from worker.backends.llama_model import Model

    model = Model(model_path)
    try:
        (brace,) = model.tokenize("{", add_special=False)
        (word,) = model.tokenize("Hello", add_special=False)
    finally:
        model.close()
    schema = SCHEMAS["enum"]
    ask = {"messages": [{"role": "user", "content": "How do you feel?"}], "max_tokens": 40, "temperature": 0,
           "json_schema": schema, "grammar_lazy": True}
    held = generate(worker.url, {**ask, "logit_bias": {str(brace): 30}})
    assert held.text.startswith("{") and held.last[1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(held.text), schema)
    free = generate(worker.url, {**ask, "logit_bias": {str(word): 100}})
    assert free.text.startswith("HelloHello") and free.last[1]["finish_reason"] == "length"


ENUM_20K = {"type": "array", "items": {"enum": [f"value-{i:05d}" for i in range(20_000)]}}


@pytest.mark.model
def test_a_20000_value_enum_compiles_once_and_holds_an_answer(model_path: Path) -> None:
    """Issue 33: llama.cpp's grammar took 1.3-18 s to mask one row of this schema (every stream on the
    worker waited); llguidance walks the token trie instead. The compiled grammar is kept: the second
    request with the same schema compiles nothing."""
    from worker.backends.llama_model import Model

    model = Model(model_path)
    try:
        first = model.constraint(grammar=None, json_schema=ENUM_20K)
        again = model.constraint(grammar=None, json_schema=ENUM_20K)
        assert first is not None and again is not None and model.grammars.compiles == 1
        for token in model.tokenize('["value-00017", "value-19999"]', add_special=False):
            assert first.allows(token), model.piece(token)
            first.accept(token)
        (bad,) = model.tokenize("x", add_special=False)
        assert not again.allows(bad)  # its own state: the first one's tokens are not its
        row = np.zeros(model.shape.n_vocab, dtype=np.float32)
        allowed = np.isfinite(again.mask(row, np.empty_like(row)))
        assert 0 < allowed.sum() < 10  # `[`, and the like: nothing else may open the answer
    finally:
        model.close()


@pytest.mark.model
def test_greedy_output_is_unchanged_where_the_grammar_allows_the_same_tokens(worker: RunningWorker) -> None:
    ask = {"messages": [{"role": "user", "content": "Write one short sentence about boats."}], "max_tokens": 24,
           "temperature": 0}
    free = generate(worker.url, ask)
    literal = json.dumps(free.text)  # a GBNF string literal of exactly that answer, escapes and all
    held = generate(worker.url, {**ask, "grammar": f"root ::= {literal}"})
    assert held.text == free.text and free.text


@pytest.mark.model
@pytest.mark.parametrize(("fields", "limit"), [
    ({"json_schema": {"enum": ["x" * 1000 + str(i) for i in range(1100)]}}, "bytes; a grammar may have at most"),
    ({"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(12_000))}, "at most 65536 characters"),
])
def test_a_grammar_past_the_budget_is_refused_before_it_takes_a_sequence(worker: RunningWorker, fields: dict,  # type: ignore[type-arg]
                                                                        limit: str) -> None:
    stream = generate(worker.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields})
    refusal = stream.refusal or stream.body  # an error event at once, or 400 from the request's own limits
    assert refusal is not None and refusal["reason"] == "invalid_request", stream
    assert limit in refusal["error"], refusal
    assert worker.load()["sessions"] == 0
