"""Tool calls on the chat route (coordinator/surfaces/tools.py), through the official `openai` client:
what the worker is sent (the tools and the choice; the conversation's calls and results as they were
made), and the calls read back in either of the workers' formats. How a worker writes them into its
model's prompt, and holds a call to a schema, is tests/worker/backends/test_tool_format.py's."""

from __future__ import annotations

import json

import pytest

from tests.coordinator.fakes import FakeWorkers, done, streaming, token
from tests.coordinator.test_surface_openai import ONE, pool, sent_body

pytestmark = pytest.mark.anyio
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def answer(text: str) -> list[bytes]:
    """A worker answer streamed in 7-character pieces."""
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    return [*(token(i, p) for i, p in enumerate(pieces)), done(n=len(pieces))]


async def test_a_required_call_is_held_to_the_functions_schemas_and_read_back() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(CALL))})
    async with pool(fakes, ONE) as (_, sdk):
        whole = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                                  tool_choice="required")
        sent = sent_body(fakes)
        stream = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                                   tool_choice="required", stream=True)
        chunks = [c async for c in stream]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    # The worker gets both functions and the choice (parallel_tool_calls defaults to true); it holds the
    # answer to a call itself, so no schema of the coordinator's goes along.
    assert sent["tools"] == {"functions": [{"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER["function"]["parameters"]},  # type: ignore[index]
                                           {"name": "get_time", "description": "",
                                            "parameters": {"type": "object", "properties": {}}}],
                             "choice": "required", "parallel": True}
    assert "json_schema" not in sent and sent["messages"] == ASK
    # Streamed: the name first, the arguments in pieces, assembling into the same call.
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = (deltas[0].tool_calls or [])[0]
    assert first.function is not None and first.function.name == "get_weather" and first.id
    arguments = "".join(((d.tool_calls or [])[0].function.arguments or "") for d in deltas
                        if (d.tool_calls or [])[0].function is not None)
    assert json.loads(arguments) == {"city": "Paris"} and len(deltas) >= 2  # the name, then the arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


async def test_a_named_function_is_the_only_shape_allowed() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(CALL))})
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          parallel_tool_calls=False)
    tools = sent_body(fakes)["tools"]
    assert (tools["choice"], tools["parallel"]) == ("get_weather", False)


@pytest.mark.parametrize("stream", [False, True])
async def test_with_auto_a_plain_answer_stays_text(stream: bool) -> None:
    fakes = FakeWorkers({"w1": streaming(answer("It is sunny."))})
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], stream=stream)  # type: ignore[call-overload, list-item]
        if stream:
            chunks = [c async for c in got]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = got.choices[0].message.content, got.choices[0].finish_reason
    assert (text, reason) == ("It is sunny.", "stop")
    sent = sent_body(fakes)  # auto (the default): the worker holds only an answer that starts as a call
    assert sent["tools"]["choice"] == "auto" and "json_schema" not in sent


async def test_with_auto_a_response_format_holds_the_answer_instead() -> None:
    fakes = FakeWorkers({"w1": streaming(answer('{"a": 1}'))})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], response_format=fmt)  # type: ignore[arg-type, list-item]
    sent = sent_body(fakes)  # the worker lets a request's own format win over an `auto` call
    assert sent["json_schema"] == {"type": "object"} and sent["tools"]["choice"] == "auto"


@pytest.mark.parametrize("stream", [False, True])
async def test_several_calls_in_one_answer_come_back_as_several_tool_calls(stream: bool) -> None:
    both = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                       {"name": "get_time", "arguments": {}}])
    fakes = FakeWorkers({"w1": streaming(answer(both))})
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],  # type: ignore[call-overload, list-item]
                                                tool_choice="required", stream=stream)
        if stream:
            chunks = [c async for c in got]
            deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            calls: dict[int, dict[str, str]] = {}
            for d in deltas:  # OpenAI's way: the index says which call a delta adds to
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            found = [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        else:
            reason = got.choices[0].finish_reason
            found = [(c.id, c.function.name, json.loads(c.function.arguments))
                     for c in got.choices[0].message.tool_calls or []]
    assert reason == "tool_calls"
    assert [(name, args) for _, name, args in found] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({ident for ident, _, _ in found}) == 2 and all(i.startswith("call_") for i, _, _ in found)


async def test_without_parallel_calls_one_call_is_held_and_a_list_is_not_read_as_calls() -> None:
    listed = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    fakes = FakeWorkers({"w1": streaming(answer(listed))})
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                                parallel_tool_calls=False)
    assert sent_body(fakes)["tools"]["parallel"] is False
    assert got.choices[0].message.tool_calls is None and got.choices[0].message.content == listed


async def test_a_round_trip_reaches_the_worker_as_calls_and_tool_turns() -> None:
    """Call, result, answer: langchain's tool loop sends the assistant's call and the tool's result back."""
    fakes = FakeWorkers({"w1": streaming(answer("It is 18 degrees in Paris."))})
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, clear"}]
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=conversation, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert got.choices[0].message.content == "It is 18 degrees in Paris."
    turns = sent_body(fakes)["messages"]
    assert turns[1:] == [{"role": "assistant", "content": "",
                          "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]},
                         {"role": "tool", "content": "18 degrees, clear", "name": "get_weather"}]


async def test_an_answer_of_several_calls_goes_back_as_one_turn_and_each_result_names_its_call() -> None:
    fakes = FakeWorkers({"w1": streaming(answer("Sunny, at noon."))})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate((("get_weather", '{"city": "Paris"}'), ("get_time", "{}")))]
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=conversation, tools=[WEATHER, TIME])  # type: ignore[arg-type, list-item]
    turns = sent_body(fakes)["messages"]
    assert turns[1]["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                      {"name": "get_time", "arguments": "{}"}]
    assert [(t["name"], t["content"]) for t in turns[2:]] == [("get_weather", "sunny"), ("get_time", "noon")]


TAGGED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "parallel", "expected"), [
    (TAGGED, True, [("get_weather", {"city": "Paris"})]),
    (TAGGED + "\n" + TAGGED.replace("Paris", "Oslo"), True, [("get_weather", {"city": "Paris"}),
                                                             ("get_weather", {"city": "Oslo"})]),
    (TAGGED + "\n" + TAGGED, False, None),  # one call an answer without parallel_tool_calls
    (TAGGED + " and more", True, None),  # the blocks must be the whole answer
    ("Sure. " + TAGGED, True, None),
    (TAGGED.replace("get_weather", "get_mood"), True, None),  # not one of the tools
    ("<tool_call>\n{\"name\": \"get_weather\"", True, None),  # cut off
    (CALL, True, [("get_weather", {"city": "Paris"})]),  # the generic format, read the same
])
async def test_calls_are_read_in_the_tagged_format_too(text: str, parallel: bool, expected: list | None) -> None:  # type: ignore[type-arg]
    fakes = FakeWorkers({"w1": streaming(answer(text))})
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                                parallel_tool_calls=parallel)
    calls = got.choices[0].message.tool_calls
    if expected is None:
        assert calls is None and got.choices[0].message.content == text
    else:
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or []] == expected
        assert got.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
async def test_bad_tool_requests_are_refused_naming_the_field(extra: dict, param: str) -> None:  # type: ignore[type-arg]
    fakes = FakeWorkers({"w1": streaming(answer("x"))})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert fakes.calls == []


async def test_with_auto_text_streams_as_it_comes_once_its_start_rules_out_a_call() -> None:
    """Before: with tools offered, a text answer came whole in one delta at its end (a chat UI showed
    nothing for seconds; llama.cpp's own suite checks for this). Now each piece goes out as it comes once
    the answer's start cannot begin a call, and the streamed text equals the whole answer."""
    text = "  Bonjour ! Comment allez-vous aujourd'hui ?"
    fakes = FakeWorkers({"w1": streaming(answer(text))})
    async with pool(fakes, ONE) as (_, sdk):
        whole = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
        stream = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], stream=True)  # type: ignore[list-item]
        chunks = [c async for c in stream]
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == whole.choices[0].message.content == text
    assert len(deltas) == len(answer(text)) - 1  # one delta per worker piece, not one at the end


@pytest.mark.parametrize("text", ['{"not": "a call"}', "[1, 2, 3] are numbers", "<tool_call>oops"])
async def test_with_auto_an_answer_that_starts_like_a_call_but_is_none_comes_out_as_text(text: str) -> None:
    fakes = FakeWorkers({"w1": streaming(answer(text))})
    async with pool(fakes, ONE) as (_, sdk):
        whole = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
        stream = await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], stream=True)  # type: ignore[list-item]
        chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == text
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
