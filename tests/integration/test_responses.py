"""The Responses surface end to end: the official `openai` client's `responses.create` against the real
coordinator and two real workers running the real model."""

from __future__ import annotations

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
