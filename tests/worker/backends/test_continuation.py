"""A stream continued on a worker that did not start it (`GenerateRequest.generated`), on the real model.

The worker is given the prompt and the tokens an earlier run had streamed (the `ids` of its token events,
cut after any event) and must go on as that run did: the same tokens after them, greedy and seeded, with a
JSON schema and with penalties; numbered on from where they stopped; `usage` counting them as completion
and ending `length` at the same total; a stop string matched across the seam; a kept session keeping the
whole answer. Its prompt cache is off, so the earlier tokens are prefilled, never found in cells a run left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sse import Stream, generate
from tests.worker.server import RunningWorker, running_worker

pytestmark = pytest.mark.model

STORY = {"prompt": "Tell me a short story about a lighthouse keeper.", "max_tokens": 36, "token_ids": True}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512, prompt_cache=False) as running:
        yield running


def ids(stream: Stream) -> list[int]:
    return [t for event in stream.tokens for t in event["ids"]]


def continued(worker: RunningWorker, body: dict[str, Any], whole: Stream, events: int) -> tuple[str, Stream]:
    """The text of `whole`'s first `events` token events, and the stream of the same request continued
    after their ids."""
    sent = whole.tokens[:events]
    generated = [t for event in sent for t in event["ids"]]
    return "".join(e["token"] for e in sent), generate(worker.url, {**body, "generated": generated})


def check_continues(worker: RunningWorker, body: dict[str, Any], cuts: tuple[int, ...] = (1, 6, 15)) -> Stream:
    """`body` streamed whole, then continued after each of `cuts` token events: each continuation gives the
    client exactly the rest, numbered on, with the whole run's usage and ending."""
    whole = generate(worker.url, body)
    assert whole.last[0] == "done", whole.last
    done = whole.last[1]
    assert len(ids(whole)) == done["usage"]["completion_tokens"] or done["finish_reason"] == "stop"
    for cut in cuts:
        assert cut < len(whole.tokens), (cut, whole.text)
        before, rest = continued(worker, body, whole, cut)
        assert rest.last[0] == "done", rest.last
        k = sum(len(e["ids"]) for e in whole.tokens[:cut])
        assert before + rest.text == whole.text, (cut, before, rest.text)
        assert ids(rest) == ids(whole)[k:]
        assert rest.tokens[0]["index"] >= k and rest.tokens[0]["index"] == whole.tokens[cut]["index"]
        assert [e["index"] for e in rest.tokens] == [e["index"] for e in whole.tokens[cut:]]
        assert rest.events[0] == ("admitted", whole.events[0][1])  # the prompt alone
        again = rest.last[1]
        assert again["finish_reason"] == done["finish_reason"]
        assert again["usage"]["prompt_tokens"] == done["usage"]["prompt_tokens"]
        assert again["usage"]["completion_tokens"] == done["usage"]["completion_tokens"]
    return whole


def test_a_greedy_stream_continues_as_it_would_have_and_ends_length_at_the_same_total(worker: RunningWorker) -> None:
    whole = check_continues(worker, {**STORY, "temperature": 0, "ignore_eos": True})
    assert whole.last[1]["finish_reason"] == "length" and whole.last[1]["usage"]["completion_tokens"] == 36


def test_a_seeded_stream_continues_with_the_draws_it_would_have_made(worker: RunningWorker) -> None:
    check_continues(worker, {**STORY, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 2024, "ignore_eos": True})


def test_a_seeded_stream_with_penalties_continues_as_it_would_have(worker: RunningWorker) -> None:
    check_continues(worker, {**STORY, "temperature": 0.9, "seed": 11, "presence_penalty": 1.2,
                             "frequency_penalty": 0.8, "repeat_penalty": 1.3, "repeat_last_n": 16,
                             "ignore_eos": True})


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "town": {"type": "string"}}, "required": ["name", "age", "town"]}


def test_a_json_schema_stream_continues_with_its_grammar_where_it_was(worker: RunningWorker) -> None:
    body = {"messages": [{"role": "user", "content": "Invent a person: name, age, town, as JSON."}],
            "json_schema": SCHEMA, "temperature": 0.7, "seed": 5, "max_tokens": 60, "token_ids": True}
    whole = check_continues(worker, body, cuts=(2, 5, 9))
    assert whole.last[1]["finish_reason"] == "stop" and whole.text.startswith("{")


WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.parametrize(("choice", "seed", "call"), [("required", 21, True), ("auto", 0, True), ("auto", 1, False)])
def test_a_tool_call_continues_held_to_its_schema_where_it_was(worker: RunningWorker, choice: str, seed: int,
                                                               call: bool) -> None:
    """`required` holds the whole answer to a call; `auto` is a lazy grammar, woken by the answer's first word
    when it starts a call: replayed over the earlier tokens, it holds the call (or leaves prose free) as it did."""
    body = {"messages": [{"role": "user", "content": "Call get_weather for Paris."}],
            "tools": {"functions": [WEATHER], "choice": choice}, "temperature": 0.8, "seed": seed, "max_tokens": 40,
            "token_ids": True}
    whole = check_continues(worker, body, cuts=(1, 3, 6))
    assert whole.text.lstrip().startswith(("{", "[")) == call, whole.text


def test_a_stop_string_matches_across_the_seam(worker: RunningWorker) -> None:
    free = generate(worker.url, {**STORY, "temperature": 0, "ignore_eos": True})
    # A stop string made of two of the answer's later tokens: held while it may begin, so never in the ids a
    # continuation gets, and found by the continuing worker when it comes.
    at = 12
    stop = free.tokens[at]["token"] + free.tokens[at + 1]["token"]
    assert free.text.find(stop) == len("".join(e["token"] for e in free.tokens[:at])) and len(stop) >= 3, stop
    body = {**STORY, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    whole = check_continues(worker, body, cuts=tuple(range(1, at)))
    assert whole.last[1]["finish_reason"] == "stop" and whole.text == free.text[:free.text.find(stop)]


def test_a_kept_session_keeps_the_whole_answer_of_a_continued_turn(worker: RunningWorker) -> None:
    body = {**STORY, "temperature": 0, "ignore_eos": True, "max_tokens": 20}
    whole = generate(worker.url, body)
    before, rest = continued(worker, {**body, "session_id": "kept-continued"}, whole, 5)
    assert before + rest.text == whole.text
    session = worker.runtime.table.lookup("kept-continued")
    assert session is not None and session.messages[-1].content == whole.text
    assert [m.role for m in session.messages] == ["user", "assistant"]


def test_a_continuation_its_grammar_refuses_or_out_of_the_vocabulary_is_refused_before_it_runs(
        worker: RunningWorker) -> None:
    hello = worker.runtime.model.tokenize("hello", add_special=False)
    held = worker.load()["sessions"]
    refused = generate(worker.url, {"prompt": "Say it.", "json_schema": SCHEMA, "max_tokens": 20,
                                    "generated": hello})
    assert refused.refusal is not None and refused.refusal["reason"] == "invalid_request"
    assert "generated.0" in refused.refusal["error"] and "grammar" in refused.refusal["error"]
    unknown = generate(worker.url, {"prompt": "Say it.", "max_tokens": 20, "generated": [10**8]})
    assert unknown.refusal is not None and "generated.0" in unknown.refusal["error"]
    assert worker.load()["sessions"] == held  # nothing ran, nothing stays reserved
