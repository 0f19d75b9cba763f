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
    # The worker was held to a call of either function, and told about them in the system turn.
    names = {shape["properties"]["name"]["const"] for shape in sent["json_schema"]["anyOf"]}
    assert names == {"get_weather", "get_time"}
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
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
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
    assert sent["grammar_lazy"] is True and sent["json_schema"]["properties"]["name"] == {"const": "get_weather"}


async def test_with_auto_a_response_format_holds_the_answer_instead() -> None:
    fakes = FakeWorkers({"w1": streaming(answer('{"a": 1}'))})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with pool(fakes, ONE) as (_, sdk):
        await sdk.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], response_format=fmt)  # type: ignore[arg-type, list-item]
    sent = sent_body(fakes)
    assert sent["json_schema"] == {"type": "object"} and not sent.get("grammar_lazy")


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
