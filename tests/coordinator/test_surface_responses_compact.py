"""`POST /v1/responses/compact` in-process: the official `openai` package's `responses.compact()` over the
app with fake workers, and the window it returns sent back as a next request's input."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import CompactedResponse

from protocol import openai_responses as rs
from tests.coordinator.fakes import FakeWorkers, streaming
from tests.coordinator.test_surface_responses import STREAM, pool, sent_body

pytestmark = pytest.mark.anyio

CONVERSATION: list[Any] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Remember: slate."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "OK."}]},
    {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "found"},
]


async def test_a_window_sent_back_is_the_conversation_it_stands_for() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, sdk, _):
        window = await sdk.responses.compact(model="smollm2", input=CONVERSATION,
                                             extra_headers={"x-request-id": "r-9"})
        compacted = window.model_dump(mode="json", exclude_none=True)["output"]
        after = await sdk.responses.create(model="smollm2", input=[*compacted, {"role": "user", "content": "Go on."}])
        whole = await client.post("/v1/responses", json={
            "model": "smollm2", "input": [*CONVERSATION, {"role": "user", "content": "Go on."}]})
    assert isinstance(window, CompactedResponse) and window.object == "response.compaction"
    assert window.id == "cmp_r-9" and [item.type for item in window.output] == ["compaction"]
    assert window.usage.input_tokens == window.usage.output_tokens == 0  # no model read anything
    assert after.status == "completed" and whole.status_code == 200
    # Only the two answers reached a worker, and they read the same conversation.
    assert len(fakes.calls) == 2 and sent_body(fakes, 0)["messages"] == sent_body(fakes, 1)["messages"]
    assert sent_body(fakes, 0)["messages"][-1] == {"role": "user", "content": "Go on."}


async def test_a_window_of_a_window_does_not_nest() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk, _):
        first = await sdk.responses.compact(model="smollm2", input=CONVERSATION[:2])
        items = first.model_dump(mode="json", exclude_none=True)["output"]
        second = await sdk.responses.compact(model="smollm2", input=[*items, *CONVERSATION[2:]])
    content = second.model_dump(mode="json")["output"][0]["encrypted_content"]
    assert rs.expand_compactions([{"type": "compaction", "encrypted_content": content}]) == CONVERSATION


async def test_a_stored_response_compacts_with_its_conversation() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, sdk, _):
        stored = await sdk.responses.create(model="smollm2", input="Hi")
        window = await sdk.responses.compact(model="smollm2", previous_response_id=stored.id, input="And now?")
        kept = rs.expand_compactions(window.model_dump(mode="json")["output"])
        unknown = await client.post("/v1/responses/compact", json={"model": "smollm2",
                                                                    "previous_response_id": "resp_nowhere"})
    assert kept[0] == {"role": "user", "content": "Hi"}
    assert kept[1]["role"] == "assistant" and kept[1]["content"][0]["text"] == "Hello!"
    assert kept[-1] == {"role": "user", "content": "And now?"}
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == rs.PREVIOUS_NOT_FOUND


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "smollm2"}, "input"),
    ({"model": "smollm2", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content"),
    ({"model": "smollm2", "input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input.0.call_id"),
])
async def test_a_bad_compact_request_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses/compact", json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["type"]) == (param, "invalid_request_error")
    assert fakes.calls == []
