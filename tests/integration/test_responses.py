"""The Responses surface end to end: the official `openai` client's `responses.create` against the real
coordinator and two real workers running the real model: text, function calls and their outputs,
and JSON held to a schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.model, pytest.mark.anyio]
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"  # general.name, lower-cased (README: model names)
INSTRUCTIONS = "You answer in one short sentence."
QUESTION = "Name three colors."


async def test_streamed_and_not_give_the_same_greedy_text(sdk: openai.AsyncOpenAI) -> None:
    whole = await sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16,
                                       temperature=0)
    stream = await sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16,
                                        temperature=0, stream=True)
    events = [event async for event in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert whole.output_text == text and text.strip()
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.type == f"response.{whole.status}" and last.response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    usage, streamed = whole.usage, last.response.usage
    assert usage is not None and streamed is not None
    assert usage.output_tokens == streamed.output_tokens <= 16
    assert usage.input_tokens == streamed.input_tokens > 5
    assert whole.model == last.response.model == MODEL


async def test_instructions_reach_the_template_as_the_system_message(sdk: openai.AsyncOpenAI) -> None:
    plain = await sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, temperature=0)
    steered = await sdk.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=1,
                                         temperature=0)
    as_item = await sdk.responses.create(model=MODEL, max_output_tokens=1, temperature=0, input=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert plain.usage is not None and steered.usage is not None and as_item.usage is not None
    # The template's default system prompt is replaced, not joined by the instructions as user text.
    assert steered.usage.input_tokens != plain.usage.input_tokens
    assert steered.usage.input_tokens == as_item.usage.input_tokens
    assert steered.status == "incomplete" and steered.incomplete_details is not None


WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}


async def test_a_required_call_streamed_and_not_then_its_output_answered(sdk: openai.AsyncOpenAI) -> None:
    ask = "What is the weather in Paris?"
    whole = await sdk.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                       parallel_tool_calls=False, temperature=0, max_output_tokens=48)
    stream = await sdk.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=48, stream=True)
    events = [event async for event in stream]
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments and events[-1].type == "response.completed"
    # The call's output goes back in; the model answers in text, the template rendering every turn.
    history = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    answer = await sdk.responses.create(model=MODEL, input=history, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type, list-item]
                                        temperature=0, max_output_tokens=24)
    assert answer.output[0].type == "message" and answer.output_text.strip()
    assert answer.usage is not None and whole.usage is not None
    assert answer.usage.input_tokens > whole.usage.input_tokens


async def test_a_json_schema_text_format_gives_valid_json(sdk: openai.AsyncOpenAI) -> None:
    got = await sdk.responses.create(model=MODEL, input="Name a city and its country.", temperature=0,
                                     max_output_tokens=64, text={"format": {  # type: ignore[typeddict-item]
                                         "type": "json_schema", "name": "place", "schema": CITY, "strict": True}})
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), CITY)
