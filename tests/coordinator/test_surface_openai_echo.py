"""`/v1/completions` with `echo`, with fake workers: what the worker is asked for (the prompt scored only when
logprobs, token ids or max_tokens 0 need it) and how its `prompt` events come back, streamed and whole, in
OpenAI's legacy logprobs shape: the prompt's tokens first, the first one's entries null, text offsets
running on into the generated text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.coordinator.fakes import FakeWorkers, sse, streaming
from tests.coordinator.test_surface_openai import ONE, pool, sent_body
from tests.coordinator.test_surface_openai_choices import done, token

pytestmark = pytest.mark.anyio


def prompt(start: int, tokens: list[str], logprobs: list[float | None],
           top: list[list[tuple[str, float]]] | None = None) -> bytes:
    return sse("prompt", {"start": start, "tokens": tokens, "logprobs": logprobs,
                          "top": top if top is not None else [[] for _ in tokens]})


# "Once upon" scored in two events (as a long prompt comes), then one generated token " a".
SCORED = [prompt(0, ["Once"], [None]), prompt(1, [" upon"], [-1.5], [[(" upon", -1.5), (" more", -2.0)]]),
          token(0, 0, " a"), done(("length", 1), prompt_tokens=2)]


async def test_echo_with_logprobs_asks_for_the_prompts_scores_and_puts_them_first() -> None:
    fakes = FakeWorkers({"w1": streaming(SCORED)})
    async with pool(fakes, ONE) as (client, _):
        answer = (await client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 1, "echo": True,
                                                             "logprobs": 1, "temperature": 0})).json()
    assert sent_body(fakes)["prompt_logprobs"] == 1
    choice = answer["choices"][0]
    assert choice["text"] == "Once upon a"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Once", " upon", " a"]
    assert lp["token_logprobs"][:2] == [None, -1.5] and lp["token_logprobs"][2] == pytest.approx(-0.693, abs=1e-3)
    assert lp["top_logprobs"][:2] == [None, {" upon": -1.5}]  # logprobs=1: the most likely only
    assert lp["text_offset"] == [0, 4, 9]


async def test_echo_streamed_sends_the_prompt_first_and_assembles_as_the_whole_answer_does() -> None:
    body = {"prompt": "Once upon", "max_tokens": 1, "echo": True, "logprobs": 2, "stream": True}
    fakes = FakeWorkers({"w1": streaming(SCORED)})
    async with pool(fakes, ONE) as (client, _):
        raw = (await client.post("/v1/completions", json=body)).text
    chunks = [json.loads(b.removeprefix("data: ")) for b in raw.split("\n\n") if b and b != "data: [DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[:3] == ["Once", " upon", " a"]
    logprobs: list[dict[str, Any]] = [c["choices"][0]["logprobs"] for c in chunks[:3]]
    assert [lp["text_offset"] for lp in logprobs] == [[0], [4], [9]]
    assert logprobs[0]["token_logprobs"] == [None] and logprobs[0]["top_logprobs"] == [None]
    assert logprobs[1]["top_logprobs"] == [{" upon": -1.5, " more": -2.0}]


async def test_echo_without_logprobs_echoes_the_prompt_as_given_and_scores_nothing() -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, 0, " a"), done(("length", 1))])})
    async with pool(fakes, ONE) as (client, _):
        whole = (await client.post("/v1/completions", json={"prompt": "Once  upon", "max_tokens": 1,
                                                            "echo": True})).json()
        streamed = (await client.post("/v1/completions", json={"prompt": "Once  upon", "max_tokens": 1,
                                                               "echo": True, "stream": True})).text
    assert "prompt_logprobs" not in sent_body(fakes)  # the prompt cache still serves it
    assert whole["choices"][0]["text"] == "Once  upon a" and whole["choices"][0]["logprobs"] is None
    texts = [json.loads(b.removeprefix("data: "))["choices"][0]["text"]
             for b in streamed.split("\n\n") if b and b != "data: [DONE]"]
    assert "".join(texts) == "Once  upon a" and texts[0] == "Once  upon"


async def test_echo_of_token_ids_or_of_nothing_generated_is_scored_and_max_tokens_0_needs_echo() -> None:
    fakes = FakeWorkers({"w1": streaming([prompt(0, ["Once", " upon"], [None, -1.5]), done(("length", 0))])})
    async with pool(fakes, ONE) as (client, _):
        ids = (await client.post("/v1/completions", json={"prompt": [9, 10], "max_tokens": 0, "echo": True})).json()
        assert sent_body(fakes)["prompt_logprobs"] == 0 and sent_body(fakes)["max_tokens"] == 0
        refused = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 0})
    assert ids["choices"][0]["text"] == "Once upon" and ids["usage"]["completion_tokens"] == 0
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


async def test_a_prompt_scored_in_several_events_comes_back_whole_past_one_events_bound() -> None:
    # 600 prompt tokens, as a worker sends them: three events of at most PROMPT_EVENT_TOKENS (256).
    words = [f" w{i}" for i in range(600)]
    events = [prompt(start, words[start:start + 256], [None if start + j == 0 else -1.0 for j in range(len(
        words[start:start + 256]))]) for start in range(0, 600, 256)]
    fakes = FakeWorkers({"w1": streaming([*events, token(0, 0, " end"), done(("length", 1), prompt_tokens=600)])})
    async with pool(fakes, ONE) as (client, _):
        answer = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "echo": True,
                                                            "logprobs": 1})
    assert answer.status_code == 200, answer.text
    lp = answer.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [*words, " end"] and len(lp["token_logprobs"]) == 601
    assert lp["text_offset"][-1] == sum(len(w) for w in words)
