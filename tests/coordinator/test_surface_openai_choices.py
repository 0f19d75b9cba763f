"""OpenAI's `n` on the coordinator, with fake workers: the request carries n to one worker, admission
reserves a sequence per choice, and the choices come back by index, streamed or whole, each with its
own finish reason (and tool call), the usage counting them all."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol import openai as oa
from tests.coordinator.fakes import FakeWorkers, heartbeat, register, sse, streaming
from tests.coordinator.test_surface_openai import ONE, SETTINGS, pool, sent_body

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "Hi"}]


def token(choice: int, index: int, text: str) -> bytes:
    data: dict[str, Any] = {"token": text, "index": index, "probability": 0.5, "finished": False}
    if choice:
        data["choice"] = choice
    return sse("token", data)


def done(*choices: tuple[str, int], prompt_tokens: int = 5) -> bytes:
    """The worker's one `done` for a request of several choices: (finish reason, tokens) of each."""
    total = sum(tokens for _, tokens in choices)
    reason = "length" if any(r == "length" for r, _ in choices) else "stop"
    return sse("done", {
        "finished": True, "finish_reason": reason,
        "usage": {"prompt_tokens": prompt_tokens, "cached_tokens": 0, "completion_tokens": total,
                  "total_tokens": prompt_tokens + total},
        "timings": {"queue_ms": 0, "prefill_ms": 1, "ttft_ms": 1, "total_ms": 2, "tokens_per_second": 10},
        "request_id": "r", "worker_id": "w1", "model": "smol",
        "choices": [{"finish_reason": r, "completion_tokens": t} for r, t in choices]})


# Three choices, their pieces interleaved as the worker's batch makes them; choice 1 stops first.
THREE = [token(0, 0, "A"), token(1, 0, "B"), token(2, 0, "C"), token(0, 1, "a"), token(2, 1, "c"),
         token(0, 2, "!"), token(2, 2, "c"), done(("length", 3), ("stop", 1), ("length", 3))]


async def test_n_whole_answers_come_back_by_index_with_their_own_endings_and_all_counted() -> None:
    fakes = FakeWorkers({"w1": streaming(THREE)})
    async with pool(fakes, ONE) as (_, sdk):
        answer = await sdk.chat.completions.create(model="smol", messages=CHAT, n=3, max_tokens=3, logprobs=True)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.message.content for c in answer.choices] == ["Aa!", "B", "Ccc"]
    assert [c.finish_reason for c in answer.choices] == ["length", "stop", "length"]
    assert [len(c.logprobs.content or []) for c in answer.choices if c.logprobs] == [3, 1, 3]
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (5, 7)
    assert sent_body(fakes)["n"] == 3 and len(fakes.calls) == 1  # one worker runs them all


async def test_n_streamed_each_choice_opens_with_its_role_and_closes_with_its_reason() -> None:
    fakes = FakeWorkers({"w1": streaming(THREE)})
    async with pool(fakes, ONE) as (client, sdk):
        stream = await sdk.chat.completions.create(model="smol", messages=CHAT, n=3, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        raw = await client.post("/v1/chat/completions", json={"messages": CHAT, "n": 3, "stream": True})
    by_index: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index.setdefault(choice.index, []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for i, text, reason in ((0, "Aa!", "length"), (1, "B", "stop"), (2, "Ccc", "length")):
        seen = by_index[i]
        assert seen[0].delta.role == "assistant" and seen[0].delta.content is None
        assert "".join(c.delta.content or "" for c in seen) == text
        assert [c.finish_reason for c in seen][-1] == reason and seen[-1].delta.content is None
        assert all(c.finish_reason is None for c in seen[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    frames = [block.removeprefix("data: ") for block in raw.text.split("\n\n") if block]
    assert frames[-1] == "[DONE]"
    for frame in frames[:-1]:
        assert len(oa.ChatCompletionChunk.model_validate_json(frame).choices) == 1  # one choice per chunk


async def test_n_completions_whole_and_streamed() -> None:
    fakes = FakeWorkers({"w1": streaming(THREE)})
    async with pool(fakes, ONE) as (_, sdk):
        whole = await sdk.completions.create(model="smol", prompt="Once", n=3, logprobs=1)
        stream = await sdk.completions.create(model="smol", prompt="Once", n=3, stream=True)
        chunks = [chunk async for chunk in stream]
    assert [(c.index, c.text, c.finish_reason) for c in whole.choices] == [
        (0, "Aa!", "length"), (1, "B", "stop"), (2, "Ccc", "length")]
    assert [c.logprobs.text_offset for c in whole.choices if c.logprobs] == [[0, 1, 2], [0], [0, 1, 2]]
    texts = ["".join(c.text for chunk in chunks for c in chunk.choices if c.index == i) for i in range(3)]
    finals = [[c.finish_reason for chunk in chunks for c in chunk.choices if c.index == i][-1] for i in range(3)]
    assert (texts, finals) == (["Aa!", "B", "Ccc"], ["length", "stop", "length"])
    assert sent_body(fakes, 0) == {"prompt": "Once", "raw": True, "model": "smol", "max_tokens": 16, "n": 3,
                                   "alternatives": 1,  # logprobs=1: the most likely token at each step
                                   "token_ids": True}  # ids: to continue each choice


async def test_n_is_bounded_by_the_pools_setting() -> None:
    fakes = FakeWorkers({"w1": streaming(THREE)})
    async with pool(fakes, ONE, settings=Settings(heartbeat_interval=1.0, queue_size=0, max_choices=2)) as (_, sdk):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(model="smol", messages=CHAT, n=3)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "n" and "at most 2" in error["message"]
    assert fakes.calls == []


async def test_admission_reserves_a_sequence_for_every_choice() -> None:
    """The worker has 4 sequences, 2 in use: 2 choices fit, 3 do not (503, never sent to it)."""
    fakes = FakeWorkers({"w1": streaming([token(0, 0, "x"), token(1, 0, "y"), done(("stop", 1), ("stop", 1))])})
    async with pool(fakes) as (client, sdk):
        beat = heartbeat("w1", timestamp=ManualClock().time(), max_sessions=4, sessions=2)  # the pool's clock
        assert (await register(client, beat)).status_code == 200
        with pytest.raises(openai.InternalServerError) as full:
            await sdk.chat.completions.create(model="smol", messages=CHAT, n=3)
        assert full.value.status_code == 503 and fakes.calls == []
        two = await sdk.chat.completions.create(model="smol", messages=CHAT, n=2)
        assert [c.message.content for c in two.choices] == ["x", "y"]
        health = (await client.get("/coordinator/health")).json()
        assert health["kv_reserved_bytes"] == 0 and health["requests_running"] == 0  # all given back


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_n_with_tools_reads_a_call_out_of_each_choice(stream: bool) -> None:
    call = json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})
    pieces = [token(0, 0, call), token(1, 0, "Sunny."), token(2, 0, call),
              done(("stop", 9), ("stop", 2), ("stop", 9))]
    fakes = FakeWorkers({"w1": streaming(pieces)})
    async with pool(fakes, ONE) as (_, sdk):
        if stream:
            chunks = [c async for c in await sdk.chat.completions.create(
                model="smol", messages=CHAT, n=3, tools=[TOOL], stream=True)]  # type: ignore[list-item]
            calls: dict[int, str] = {}
            contents: dict[int, str] = {}
            finals: dict[int, str | None] = {}
            for chunk in chunks:
                for c in chunk.choices:
                    for delta in c.delta.tool_calls or []:
                        calls[c.index] = calls.get(c.index, "") + (delta.id or "")
                    contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
                    finals[c.index] = c.finish_reason or finals.get(c.index)
            assert finals == {0: "tool_calls", 1: "stop", 2: "tool_calls"} and contents[1] == "Sunny."
            ids = [calls[0], calls[2]]
        else:
            answer = await sdk.chat.completions.create(model="smol", messages=CHAT, n=3,
                                                       tools=[TOOL])  # type: ignore[list-item]
            assert [c.finish_reason for c in answer.choices] == ["tool_calls", "stop", "tool_calls"]
            assert answer.choices[1].message.content == "Sunny." and not answer.choices[1].message.tool_calls
            ids = [c.message.tool_calls[0].id for c in (answer.choices[0], answer.choices[2])
                   if c.message.tool_calls]
    assert len(ids) == 2 and ids[0] != ids[1] and all(i.startswith("call_") for i in ids)


async def test_one_choice_is_sent_to_the_worker_as_before() -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, 0, "x"), done(("stop", 1))])})
    async with pool(fakes, ONE, settings=SETTINGS) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=CHAT, n=1)
    assert "n" not in sent_body(fakes)
