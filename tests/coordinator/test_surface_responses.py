"""The Responses surface (`POST /v1/responses`) in-process: fake workers behind httpx.MockTransport, the
official `openai` client over an ASGI transport, and raw HTTP where the wire itself is the point.
Every event and object is checked against both the pool's own types (protocol/openai_responses.py)
and the official package's (`openai.types.responses`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseCompletedEvent, ResponseCreatedEvent, ResponseStreamEvent

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.state import CoordinatorState
from coordinator.surfaces.responses_format import Echo, EventEncoder, Shape
from protocol import openai_responses as rs
from protocol.sse import SseEvent, SseParser
from tests.coordinator.fakes import (
    FakeWorkers,
    done,
    events_of,
    heartbeat,
    refusing,
    register,
    running_app,
    sse,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)  # 503 at once at capacity
STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done(n=3)]
BROKEN = [token(0, "He"), sse("error", {"error": "engine failure", "reason": "engine_failed", "request_id": "r",
                                        "finished": True})]
SDK_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
OPENING = [rs.CREATED, rs.IN_PROGRESS, rs.OUTPUT_ITEM_ADDED, rs.CONTENT_PART_ADDED]
CLOSING = [rs.OUTPUT_TEXT_DONE, rs.CONTENT_PART_DONE, rs.OUTPUT_ITEM_DONE]
OWN_EVENT: dict[str, type[pydantic.BaseModel]] = {
    **dict.fromkeys([rs.CREATED, rs.IN_PROGRESS, rs.COMPLETED, rs.INCOMPLETE, rs.FAILED], rs.ResponseEvent),
    **dict.fromkeys([rs.OUTPUT_ITEM_ADDED, rs.OUTPUT_ITEM_DONE], rs.OutputItemEvent),
    **dict.fromkeys([rs.CONTENT_PART_ADDED, rs.CONTENT_PART_DONE], rs.ContentPartEvent),
    rs.OUTPUT_TEXT_DELTA: rs.TextDeltaEvent, rs.OUTPUT_TEXT_DONE: rs.TextDoneEvent,
    rs.ARGUMENTS_DELTA: rs.ArgumentsDeltaEvent, rs.ARGUMENTS_DONE: rs.ArgumentsDoneEvent}


@asynccontextmanager
async def pool(fakes: FakeWorkers, settings: Settings = SETTINGS, workers: tuple[str, ...] = ("w1",)
               ) -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI, CoordinatorState]]:
    """The app with `workers` serving `smol` (alias `smollm2`); an httpx client, an SDK client over the
    same app, and the app's state."""
    clock = ManualClock()
    async with running_app(settings, fakes, clock) as client:
        for worker_id in workers:
            beat = heartbeat(worker_id, timestamp=clock.time(), aliases=("smollm2",))
            assert (await register(client, beat)).status_code == 200
        sdk = openai.AsyncOpenAI(base_url="http://coord/v1", api_key="none", max_retries=0,
                                 http_client=httpx.AsyncClient(transport=client._transport,  # type: ignore[arg-type]
                                                               base_url="http://coord"))
        try:
            yield client, sdk, client._transport.app.state.coordinator  # type: ignore[attr-defined]
        finally:
            await sdk.close()


def sent_body(fakes: FakeWorkers, i: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(fakes.calls[i][1].content)
    return body


def checked_events(text: str) -> list[dict[str, Any]]:
    """The stream's events, each with its `event:` line equal to its `type`, parsed by the pool's type for
    it and by the official package's union of stream events (a failed response's `error.code` is the
    pool's reason string, outside OpenAI's list of codes, so that event is parsed by the pool's type only)."""
    events = []
    for name, data in events_of(text):
        assert name == data["type"] and name in rs.STREAM_EVENTS
        OWN_EVENT[name].model_validate(data)
        if name != rs.FAILED:
            SDK_EVENT.validate_python(data)
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_a_response_through_the_sdk_has_the_text_usage_and_the_request_echoed() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, sdk, _):
        answer = await sdk.responses.create(model="smollm2", input="Hi", instructions="Be brief.",
                                            max_output_tokens=5, metadata={"ticket": "42"},
                                            extra_headers={"x-request-id": "r-1"})
        raw = await client.post("/v1/responses", json={"model": "smol", "input": "Hi"})
    assert answer.output_text == "Hello!"
    assert (answer.id, answer.object, answer.status, answer.model) == ("resp_r-1", "response", "completed", "smol")
    message = answer.output[0]
    assert message.type == "message" and (message.id, message.status, message.role) == ("msg_r-1", "completed",
                                                                                         "assistant")
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens, answer.usage.total_tokens) == (5, 3, 8)
    assert answer.usage.input_tokens_details.cached_tokens == 0
    assert answer.usage.output_tokens_details.reasoning_tokens == 0
    assert (answer.instructions, answer.max_output_tokens, answer.metadata) == ("Be brief.", 5, {"ticket": "42"})
    # Sampling as the worker applied it: the pool's defaults, since the request left it out.
    assert (answer.temperature, answer.top_p) == (0.8, 0.95)
    assert (answer.tools, answer.tool_choice, answer.parallel_tool_calls) == ([], "auto", True)
    assert answer.text is not None and answer.text.format is not None and answer.text.format.type == "text"
    assert answer.error is None and answer.incomplete_details is None and answer.completed_at == 1_700_000_000
    # The raw body is exactly the pool's type and passes the official type's own validation.
    assert raw.status_code == 200 and raw.headers["x-worker-id"] == "w1"
    rs.ResponseObject.model_validate(raw.json())
    assert SdkResponse.model_validate(raw.json()).output_text == "Hello!"
    # Instructions go first, as a system message; no logprobs are offered, so the worker skips them.
    assert sent_body(fakes, 0) == {"model": "smollm2", "max_tokens": 5, "probabilities": False, "token_ids": True, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


async def test_the_response_has_every_field_open_responses_requires() -> None:
    """The Open Responses specification's `ResponseResource` requires these (null where nullable), and
    lists function tools with their description, parameters and strict."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        raw = await client.post("/v1/responses", json={"model": "smol", "input": "Hi", "tools": [
            {"type": "function", "name": "f"}, {"type": "web_search"}]})
    body = raw.json()
    assert raw.status_code == 200, raw.text
    assert {k: body[k] for k in ("presence_penalty", "frequency_penalty", "top_logprobs", "max_tool_calls",
                                 "service_tier", "safety_identifier", "prompt_cache_key")} == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0, "max_tool_calls": None,
        "service_tier": "default", "safety_identifier": None, "prompt_cache_key": None}
    assert body["tools"] == [{"type": "function", "name": "f", "description": None, "parameters": None,
                              "strict": None}, {"type": "web_search"}]
    assert isinstance(body["temperature"], float) and isinstance(body["top_p"], float)
    SdkResponse.model_validate(body)


async def test_message_items_reach_the_worker_as_messages_in_order() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                        {"type": "input_text", "text": " there"}]},
        # An earlier answer sent back as it came out (`output` items carry more fields; they are ignored).
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
        {"role": "user", "content": "And again?"},
    ]
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={
            "input": items, "instructions": "Be brief.", "temperature": 0, "top_p": 0.5, "seed": 7, "top_k": 3,
            "session_id": "s1", "ignore_eos": True, "user": "u-1", "keep_alive": "2m"})
    assert response.status_code == 200, response.text
    # No model named: the pool's only one serves it, and the worker is told nothing about it. A new
    # session's first turn asks for its token ids: it may be continued on another worker.
    assert sent_body(fakes) == {
        "max_tokens": 32_768, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 7, "session_id": "s1",
        "ignore_eos": True, "probabilities": False, "keep_alive": 120.0, "token_ids": True, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "And again?"}]}
    body = response.json()
    assert (body["temperature"], body["top_p"], body["user"]) == (0, 0.5, "u-1")


async def test_a_stream_through_the_sdk_sends_every_event_in_order_and_the_same_text() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk, _):
        stream = await sdk.responses.create(model="smol", input="Hi", stream=True)
        events = [event async for event in stream]
        whole = await sdk.responses.create(model="smol", input="Hi")
    assert [e.type for e in events] == [*OPENING, *[rs.OUTPUT_TEXT_DELTA] * 3, *CLOSING, rs.COMPLETED]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["He", "llo", "!"]
    first, last = events[0], events[-1]
    assert isinstance(first, ResponseCreatedEvent) and isinstance(last, ResponseCompletedEvent)
    assert last.response.output_text == "".join(deltas) == whole.output_text
    assert last.response.usage is not None and last.response.usage.output_tokens == 3
    assert last.response.id == first.response.id and first.response.status == "in_progress"
    assert sent_body(fakes, 0)["probabilities"] is False


async def test_the_wire_names_each_event_and_every_event_parses() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={"input": "Hi", "stream": True},
                                     headers={"x-request-id": "r-2"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = checked_events(response.text)
    delta = events[4]
    assert delta == {"type": rs.OUTPUT_TEXT_DELTA, "sequence_number": 4, "item_id": "msg_r-2", "output_index": 0,
                     "content_index": 0, "delta": "He", "logprobs": []}
    assert events[-4]["text"] == "Hello!" and events[-3]["part"]["text"] == "Hello!"
    assert events[-2]["item"]["status"] == "completed"
    assert events[-1]["response"]["output"] == [events[-2]["item"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_running_out_of_tokens_is_an_incomplete_response(stream: bool) -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, "Hi"), done(n=1, reason="length")])})
    async with pool(fakes) as (client, sdk, _):
        raw = await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1, "stream": stream})
        answer = await sdk.responses.create(model="smol", input="x", max_output_tokens=1)
    if stream:
        events = checked_events(raw.text)
        assert events[-1]["type"] == rs.INCOMPLETE and events[-2]["item"]["status"] == "incomplete"
        body = events[-1]["response"]
    else:
        body = raw.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["completed_at"] is None and body["output"][0]["content"][0]["text"] == "Hi"
    assert answer.status == "incomplete" and answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens" and answer.output_text == "Hi"


async def test_an_error_after_the_first_token_is_a_failed_response_that_ends_the_stream() -> None:
    fakes = FakeWorkers({"w1": streaming(BROKEN)})
    async with pool(fakes) as (client, sdk, state):
        raw = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
        stream = await sdk.responses.create(model="smol", input="Hi", stream=True)
        seen = [event async for event in stream]
        # Not streamed: nothing was sent yet, so the failure is a status code, in OpenAI's shape.
        whole = await client.post("/v1/responses", json={"input": "Hi"})
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.responses.create(model="smol", input="Hi")
        assert (state.admission.in_flight, len(state.streams)) == (0, 0)
    events = checked_events(raw.text)
    assert [e["type"] for e in events] == [*OPENING, rs.OUTPUT_TEXT_DELTA, rs.FAILED]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "engine_failed", "message": "engine failure"}
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "He"
    assert seen[-1].type == "response.failed" and seen[-1].response.error is not None
    assert seen[-1].response.error.code == "engine_failed"
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "engine_failed"
    assert caught.value.status_code == 502


async def first_turn_on_w1_then_w1_busier(client: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> Any:
    """A first turn ("Be brief.", "Hi"), which goes to w1 (a tie goes to the lower id); then w1 beats as
    the busier worker, so by score alone a next request would go to w2. The first turn's raw response."""
    first = await sdk.responses.with_raw_response.create(model="smol", instructions="Be brief.", input="Hi")
    assert first.headers["x-worker-id"] == "w1"
    assert (await register(client, heartbeat("w1", timestamp=1_700_000_000.0, sessions=3))).status_code == 200
    return first


async def test_a_next_turn_goes_back_to_the_worker_that_served_the_conversation() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, workers=("w1", "w2")) as (client, sdk, _):
        first = await first_turn_on_w1_then_w1_busier(client, sdk)
        history: list[Any] = [{"role": "user", "content": "Hi"}, *[item.model_dump() for item in first.parse().output],
                              {"role": "user", "content": "And then?"}]
        turn = await client.post("/v1/responses", json={"instructions": "Be brief.", "input": history})
        other = await client.post("/v1/responses", json={"instructions": "Be brief.", "input": "New"})
    assert turn.headers["x-worker-id"] == "w1" and other.headers["x-worker-id"] == "w2"
    assert sent_body(fakes, 1)["messages"][2] == {"role": "assistant", "content": "Hello!"}


def internal(raw: bytes) -> SseEvent:
    """A fake worker's SSE bytes as the relay hands the event to an encoder."""
    (event,) = SseParser().feed(raw)
    return event


ERROR = sse("error", {"error": "ran past 5 s", "reason": "deadline_exceeded", "request_id": "r", "finished": True})
ENCODED: list[tuple[str, list[bytes], list[str], str | None]] = [
    # (case, internal events, event types written, text of the final response's message: None for none)
    ("tokens then done", [token(0, "a"), token(1, 'say "hi"\n\u00e9'), done(n=2)],
     [*OPENING, rs.OUTPUT_TEXT_DELTA, rs.OUTPUT_TEXT_DELTA, *CLOSING, rs.COMPLETED], 'asay "hi"\n\u00e9'),
    ("done without a token", [done(n=0)], [*OPENING, *CLOSING, rs.COMPLETED], ""),
    ("out of tokens", [token(0, "a"), done(n=1, reason="length")],
     [*OPENING, rs.OUTPUT_TEXT_DELTA, *CLOSING, rs.INCOMPLETE], "a"),
    ("an error first", [ERROR], [rs.CREATED, rs.IN_PROGRESS, rs.FAILED], None),
    ("an error after a token", [token(0, "a"), ERROR], [*OPENING, rs.OUTPUT_TEXT_DELTA, rs.FAILED], "a"),
    ("an unknown event", [sse("admitted", {"prompt_tokens": 5}), done(n=0)], [*OPENING, *CLOSING, rs.COMPLETED], ""),
]


@pytest.mark.parametrize(("events", "types", "text"), [c[1:] for c in ENCODED], ids=[c[0] for c in ENCODED])
def test_the_encoder_writes_every_ending_as_a_well_formed_stream(events: list[bytes], types: list[str],
                                                                 text: str | None) -> None:
    shape = Shape(Echo(stream=True), "r-1", 1_700_000_000, "smol")
    encoder = EventEncoder(shape, now=lambda: 1_700_000_005.0)
    written = checked_events(b"".join(encoder(internal(raw)) for raw in events).decode())
    assert [e["type"] for e in written] == types
    final = written[-1]["response"]
    assert final["id"] == "resp_r-1" and {e["response"]["id"] for e in written if "response" in e} == {"resp_r-1"}
    assert [m["content"][0]["text"] for m in final["output"]] == ([] if text is None else [text])
    assert "".join(e["delta"] for e in written if e["type"] == rs.OUTPUT_TEXT_DELTA) == (text or "")
    assert final["completed_at"] == (1_700_000_005 if types[-1] == rs.COMPLETED else None)


async def test_a_fault_in_the_encoder_ends_the_stream_with_a_failed_response(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: EventEncoder, text: str) -> bytes:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(EventEncoder, "_text", broken)
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, state):
        async with asyncio.timeout(5):
            raw = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
        assert (state.admission.in_flight, len(state.streams)) == (0, 0)
    # The opening events built with the first token never went out: the failure still opens the response.
    events = checked_events(raw.text)
    assert [e["type"] for e in events] == [rs.CREATED, rs.IN_PROGRESS, rs.FAILED]
    assert events[-1]["response"]["error"]["code"] == "internal"


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": "high"}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f"}]}, "input.1.arguments"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.0.output"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    # An output answering no call of the conversation (as OpenAI refuses it), here or before a message.
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input.1.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "d", "output": "1"}]}, "input.1.call_id"),
    # A compaction window this pool did not make.
    ({"input": [{"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAfromelsewhere"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": {"k": 1}}, "metadata.k"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED, ids=[p for _, p in REFUSED])
async def test_what_this_pool_cannot_honour_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={"input": "x", **body}, headers={"x-request-id": "r-3"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_request", "invalid_request_error")
    assert error["message"] and response.headers["x-request-id"] == "r-3"
    assert fakes.calls == []


async def test_the_sdk_reads_refusals_as_its_own_errors() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk, _):
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.responses.create(model="smol", input="x", background=True)
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.responses.create(model="gpt-9", input="x")
    assert (bad.value.param, bad.value.code) == ("background", "invalid_request")
    assert "keeps no background responses" in bad.value.message
    assert (unknown.value.param, unknown.value.code) == ("model", "unknown_model") and "smol" in unknown.value.message
    assert fakes.calls == []


async def test_values_that_change_nothing_are_accepted_and_echoed() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={
            "input": "x", "tools": [], "tool_choice": "none", "text": {"format": {"type": "text"}}, "reasoning": {},
            "include": [], "background": False, "truncation": "disabled", "store": True, "previous_response_id": None,
            "parallel_tool_calls": False, "metadata": {}, "service_tier": "auto", "some_future_field": {"a": 1}})
        effortless = await client.post("/v1/responses", json={"input": "x", "reasoning": {"effort": None},
                                                              "store": False, "tool_choice": "auto"})
    assert response.status_code == 200, response.text
    assert (response.json()["tool_choice"], response.json()["parallel_tool_calls"]) == ("none", False)
    assert effortless.status_code == 200, effortless.text


async def test_at_capacity_the_sdk_sees_503_with_retry_after() -> None:
    fakes = FakeWorkers({"w1": refusing(503, "sessions_full", retry_after=2)})
    async with pool(fakes) as (client, sdk, _):
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk.responses.create(model="smol", input="x")
        raw = await client.post("/v1/responses", json={"input": "x", "stream": True})
    assert caught.value.status_code == 503
    assert raw.status_code == 503 and raw.headers["retry-after"] == "2"
    assert raw.json()["error"] == {"message": "every eligible worker refused: sessions_full",
                                   "type": "server_error", "param": None, "code": "sessions_full"}


async def test_api_keys_guard_the_route_and_the_key_names_the_tenant() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, api_keys="alpha-key-1")
    async with pool(fakes, settings) as (client, _, _):
        refused = await client.post("/v1/responses", json={"input": "x"})
        with_key = await client.post("/v1/responses", json={"input": "x"},
                                     headers={"authorization": "Bearer alpha-key-1"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert with_key.status_code == 200 and sent_body(fakes)["tenant"]


async def test_stored_responses_are_not_served() -> None:
    async with pool(FakeWorkers({})) as (client, _, _):
        fetched = await client.get("/v1/responses/resp_1")
        listed = await client.get("/v1/responses")
    assert fetched.status_code == 404 and fetched.json()["error"]["type"] == "invalid_request_error"
    assert listed.status_code == 405 and "error" in listed.json()


async def test_the_route_is_documented_with_its_body_json_answer_and_event_stream() -> None:
    async with pool(FakeWorkers({})) as (client, _, _):
        spec = (await client.get("/openapi.json")).json()
    operation = spec["paths"]["/v1/responses"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["input"] and body["properties"]["truncation"]["enum"] == ["disabled"]
    answer = operation["responses"]["200"]["content"]
    assert set(answer) == {"text/event-stream", "application/json"}
    assert answer["text/event-stream"]["itemSchema"]["properties"]["event"]["enum"] == list(rs.STREAM_EVENTS)
    assert {"400", "401", "404", "503"} <= set(operation["responses"])
