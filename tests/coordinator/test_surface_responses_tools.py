"""Function tools and structured text on the Responses surface, through the official `openai` client:
what the worker is sent (the same generic format and schemas as on the chat route), the calls read
back as `function_call` items, their streamed events, and a round trip with the call's output."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import openai_responses as rs
from tests.coordinator.fakes import FakeWorkers, streaming
from tests.coordinator.test_surface_responses import checked_events, pool, sent_body
from tests.coordinator.test_surface_tools import CALL, answer

pytestmark = pytest.mark.anyio
WEATHER: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME: dict[str, Any] = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
TWO_CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'


async def test_a_required_call_comes_back_as_a_function_call_item() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(CALL))})
    async with pool(fakes) as (_, sdk, _):
        got = await sdk.responses.create(model="smol", input="Weather in Paris?", tools=[WEATHER, TIME],  # type: ignore[list-item]
                                         tool_choice="required", extra_headers={"x-request-id": "r-7"})
    sent = sent_body(fakes)
    (call,) = got.output
    assert call.type == "function_call" and (call.id, call.status) == ("fc_r-7", "completed")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and got.status == "completed" and got.output_text == ""
    # The request's tools and choice are echoed as given.
    assert [t.name for t in got.tools] == ["get_weather", "get_time"] and got.tool_choice == "required"
    # The worker got the tools and the choice, as on the chat route; it holds the answer to a call.
    assert [f["name"] for f in sent["tools"]["functions"]] == ["get_weather", "get_time"]
    assert (sent["tools"]["choice"], sent["tools"]["parallel"]) == ("required", True)
    assert sent["messages"] == [{"role": "user", "content": "Weather in Paris?"}] and "json_schema" not in sent


async def test_a_named_function_holds_the_answer_to_its_own_parameters() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(CALL))})
    async with pool(fakes) as (_, sdk, _):
        got = await sdk.responses.create(model="smol", input="Weather?", tools=[WEATHER, TIME],  # type: ignore[list-item]
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         parallel_tool_calls=False)
    tools = sent_body(fakes)["tools"]
    assert (tools["choice"], tools["parallel"]) == ("get_weather", False)
    assert tools["functions"][0]["parameters"] == WEATHER["parameters"]
    assert got.tool_choice.type == "function" and got.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    assert got.parallel_tool_calls is False


async def test_streamed_calls_send_each_item_its_arguments_in_pieces_and_their_end() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(TWO_CALLS))})
    async with pool(fakes) as (client, sdk, _):
        whole = await sdk.responses.create(model="smol", input="Both?", tools=[WEATHER, TIME])  # type: ignore[list-item]
        raw = await client.post("/v1/responses", json={"input": "Both?", "tools": [WEATHER, TIME], "stream": True})
        stream = await sdk.responses.create(model="smol", input="Both?", tools=[WEATHER, TIME], stream=True)  # type: ignore[list-item]
        sdk_events = [event async for event in stream]
    events = checked_events(raw.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == [rs.CREATED, rs.IN_PROGRESS] and kinds[-1] == rs.COMPLETED
    assert rs.OUTPUT_TEXT_DELTA not in kinds and rs.CONTENT_PART_ADDED not in kinds
    for index, name in enumerate(("get_weather", "get_time")):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == rs.OUTPUT_ITEM_ADDED and mine[0]["item"]["arguments"] == ""
        assert mine[0]["item"]["status"] == "in_progress" and mine[0]["item"]["name"] == name
        assert mine[-2]["type"] == rs.ARGUMENTS_DONE and mine[-1]["type"] == rs.OUTPUT_ITEM_DONE
        pieces = "".join(e["delta"] for e in mine if e["type"] == rs.ARGUMENTS_DELTA)
        assert pieces == mine[-2]["arguments"] == mine[-1]["item"]["arguments"]
        assert mine[-1]["item"]["status"] == "completed"
    # The streamed calls are the non-streamed answer's, ids included (the request id differs, so not those).
    final = events[-1]["response"]["output"]
    assert [(c["name"], c["arguments"]) for c in final] == [(c.name, c.arguments) for c in whole.output]  # type: ignore[union-attr]
    assert [json.loads(c.arguments) for c in whole.output] == [{"city": "Paris"}, {}]  # type: ignore[union-attr]
    assert len({c["call_id"] for c in final}) == 2 and final[1]["id"].endswith("_1")
    assert sdk_events[-1].type == "response.completed"


@pytest.mark.parametrize("stream", [False, True])
async def test_with_auto_a_plain_answer_stays_a_message(stream: bool) -> None:
    fakes = FakeWorkers({"w1": streaming(answer("It is sunny in Paris today."))})
    async with pool(fakes) as (client, _, _):
        raw = await client.post("/v1/responses", json={"input": "Weather?", "tools": [WEATHER], "stream": stream})
    sent = sent_body(fakes)
    assert sent["tools"]["choice"] == "auto" and "json_schema" not in sent
    if not stream:
        assert raw.json()["output"][0]["content"][0]["text"] == "It is sunny in Paris today."
        return
    events = checked_events(raw.text)
    # Its first letters rule out a call: it streams as the worker sends it, piece by piece.
    deltas = [e["delta"] for e in events if e["type"] == rs.OUTPUT_TEXT_DELTA]
    text = "It is sunny in Paris today."
    assert deltas == [text[i:i + 7] for i in range(0, len(text), 7)]
    assert events[-1]["response"]["output"][0]["type"] == "message"


async def test_a_round_trip_with_the_calls_output_reaches_the_worker_as_a_call_and_a_tool_turn() -> None:
    fakes = FakeWorkers({"w1": streaming(answer(CALL))})
    async with pool(fakes) as (_, sdk, _):
        first = await sdk.responses.create(model="smol", input="Weather in Paris?", tools=[WEATHER, TIME],  # type: ignore[list-item]
                                           instructions="Be brief.")
        call = first.output[0]
        fakes.behaviours["w1"] = streaming(answer("It is 18 degrees in Paris."))
        # What the SDK's users send next: the input so far, the answer's output items, the call's output.
        history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump() for o in first.output],
                              {"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
                               "output": "18 degrees, clear"}]
        second = await sdk.responses.create(model="smol", input=history, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                            instructions="Be brief.")
    assert second.output_text == "It is 18 degrees in Paris."
    turns = sent_body(fakes)["messages"]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
    assert turns[0]["content"] == "Be brief."
    ((name, arguments),) = [(c["name"], c["arguments"]) for c in turns[2]["tool_calls"]]
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert (turns[3]["name"], turns[3]["content"]) == ("get_weather", "18 degrees, clear")


async def test_several_calls_go_back_as_one_assistant_turn() -> None:
    fakes = FakeWorkers({"w1": streaming(answer("Sunny, at noon."))})
    history = [{"role": "user", "content": "Both?"},
               {"type": "function_call", "call_id": "c0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c0", "output": [{"type": "input_text", "text": "sunny"}]},
               {"type": "function_call_output", "call_id": "c1", "output": "noon"}]
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={"input": history, "tools": [WEATHER, TIME]})
    assert response.status_code == 200, response.text
    turns = sent_body(fakes)["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "tool"]
    assert turns[1]["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                      {"name": "get_time", "arguments": "{}"}]
    assert [(t["name"], t["content"]) for t in turns[2:]] == [("get_weather", "sunny"), ("get_time", "noon")]


@pytest.mark.parametrize(("text_format", "schema"), [
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "name": "city", "strict": True,
      "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
     {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}),
])
async def test_a_text_format_holds_the_answer_to_its_schema_and_is_echoed(text_format: dict[str, Any],
                                                                          schema: dict[str, Any]) -> None:
    fakes = FakeWorkers({"w1": streaming(answer('{"name": "Paris"}'))})
    async with pool(fakes) as (_, sdk, _):
        got = await sdk.responses.create(model="smol", input="A city?", text={"format": text_format})  # type: ignore[typeddict-item]
    assert sent_body(fakes)["json_schema"] == schema and "tools" not in sent_body(fakes)
    assert json.loads(got.output_text) == {"name": "Paris"}
    assert got.text is not None and got.text.format is not None and got.text.format.type == text_format["type"]


async def test_with_auto_a_text_format_holds_the_answer_instead_of_a_call() -> None:
    fakes = FakeWorkers({"w1": streaming(answer('{"name": "Paris"}'))})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={
            "input": "A city?", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}})
    assert response.status_code == 200, response.text
    sent = sent_body(fakes)
    assert sent["json_schema"] == {"type": "object"} and sent["tools"]["choice"] == "auto"
    assert response.json()["output"][0]["type"] == "message"
