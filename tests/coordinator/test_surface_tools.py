"""Tool calls on the chat route (coordinator/surfaces/tools.py), through the official `openai` client:
the format the worker is sent, the schema a required call is held to, and the calls read back."""

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
    # The worker was held to a call of either function, or a list of such calls (parallel_tool_calls
    # defaults to true), and told about them in the system turn.
    *single, several = sent["json_schema"]["anyOf"]
    assert {shape["properties"]["name"]["const"] for shape in single} == {"get_weather", "get_time"}
    assert several["type"] == "array" and several["items"] == {"anyOf": single} and several["minItems"] == 1
    assert sent["messages"][0]["role"] == "system" and '"name": "get_weather"' in sent["messages"][0]["content"]
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
    schema = sent_body(fakes)["json_schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]  # type: ignore[index]


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
    sent = sent_body(fakes)  # auto: the call's schema, held lazily (only an answer that starts as a call)
    assert sent["grammar_lazy"] is True and sent["json_schema"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}


async def test_with_auto_a_response_format_holds_the_answer_instead() -> None:
    fakes = FakeWorkers({"w1": streaming(answer('{"a": 1}'))})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], response_format=fmt)  # type: ignore[arg-type, list-item]
    sent = sent_body(fakes)
    assert sent["json_schema"] == {"type": "object"} and not sent.get("grammar_lazy")


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
    sent = sent_body(fakes)
    assert sent["json_schema"]["properties"]["name"] == {"const": "get_weather"}  # one object, no list
    assert "JSON list" not in sent["messages"][0]["content"]
    assert got.choices[0].message.tool_calls is None and got.choices[0].message.content == listed


async def test_a_round_trip_reaches_the_worker_as_plain_turns() -> None:
    """Call, result, answer: langchain's tool loop sends the assistant's call and the tool's result back."""
    fakes = FakeWorkers({"w1": streaming(answer("It is 18 degrees in Paris."))})
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, clear"}]
    async with pool(fakes, ONE) as (_, sdk):
        got = await sdk.chat.completions.create(model="smol", messages=conversation, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert got.choices[0].message.content == "It is 18 degrees in Paris."
    turns = sent_body(fakes)["messages"]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert json.loads(turns[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert turns[3]["content"] == "Result of get_weather: 18 degrees, clear"


async def test_an_answer_of_several_calls_goes_back_as_the_list_the_model_wrote() -> None:
    fakes = FakeWorkers({"w1": streaming(answer("Sunny, at noon."))})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate((("get_weather", '{"city": "Paris"}'), ("get_time", "{}")))]
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=conversation, tools=[WEATHER, TIME])  # type: ignore[arg-type, list-item]
    turns = sent_body(fakes)["messages"]
    assert json.loads(turns[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                               {"name": "get_time", "arguments": {}}]
    assert [t["content"] for t in turns[3:]] == ["Result of get_weather: sunny", "Result of get_time: noon"]


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
