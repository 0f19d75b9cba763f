"""Anthropic's Messages API in-process: fake workers behind httpx.MockTransport, and the official `anthropic`
client (over an ASGI transport) as well as raw HTTP where the wire itself is the point."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator import fakes as fake
from tests.coordinator.fakes import FakeWorkers, events_of, sse, streaming, token

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)  # 503 at once at capacity
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def done(*, prompt: int = 10, cached: int = 0, n: int = 3, reason: str = "stop") -> bytes:
    return sse("done", {
        "finished": True, "finish_reason": reason,
        "usage": {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": n, "total_tokens": prompt + n},
        "timings": {"queue_ms": 0, "prefill_ms": 1, "ttft_ms": 1, "total_ms": 2, "tokens_per_second": 10},
        "request_id": "r", "worker_id": "w1", "model": fake.MODEL})


STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done()]


def pieces(text: str, size: int = 7) -> list[bytes]:
    return [token(i, text[at:at + size]) for i, at in enumerate(range(0, len(text), size))]


@asynccontextmanager
async def pool(fakes: FakeWorkers, settings: Settings = SETTINGS, api_key: str = "none"
               ) -> AsyncIterator[tuple[httpx.AsyncClient, anthropic.AsyncAnthropic]]:
    """The app with worker w1 registered; an httpx client and an SDK client."""
    clock = ManualClock()
    app = create_app(settings, clock=clock, worker_client=fakes.client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://coord") as client:
        assert (await fake.register(client, fake.heartbeat("w1", timestamp=clock.time()))).status_code == 200
        sdk = sdk_for(app, api_key)
        try:
            yield client, sdk
        finally:
            await sdk.close()


def sdk_for(app: object, api_key: str) -> anthropic.AsyncAnthropic:
    """The official client over an ASGI transport of the httpx fork it is built on (`httpx2`)."""
    return anthropic.AsyncAnthropic(base_url="http://coord", api_key=api_key, max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),  # type: ignore[arg-type]
                                                                   base_url="http://coord"))


def sent(fakes: FakeWorkers, i: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(fakes.calls[i][1].content)
    return body


async def test_a_message_through_the_sdk_sends_the_turns_to_the_template() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk):
        message = await sdk.messages.create(
            model="smol", max_tokens=5, stop_sequences=["END"], metadata={"user_id": "u1"},
            extra_body={"temperature": 0.5, "top_k": 7},  # this SDK's create() names neither any more
            system=[{"type": "text", "text": "Be brief."},
                    {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]}],
            extra_headers={"anthropic-beta": "claude-code-20250219"})
    assert message.type == "message" and message.role == "assistant" and message.model == fake.MODEL
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", "Hello!")]
    assert message.stop_reason == "end_turn" and message.id.startswith("msg_")
    # A breakpoint: the prompt (none of it reused) was written to a cache kept 5 minutes, none of it plain input.
    assert (message.usage.input_tokens, message.usage.output_tokens) == (0, 3)
    assert (message.usage.cache_read_input_tokens, message.usage.cache_creation_input_tokens) == (0, 10)
    assert message._request_id  # the SDK reads it from `request-id`
    assert sent(fakes) == {"messages": [{"role": "system", "content": "Be brief.\n\nAnswer in English."},
                                        {"role": "user", "content": "Say hi"}],
                           "model": "smol", "max_tokens": 5, "probabilities": False, "temperature": 0.5, "top_k": 7,
                           "stop": ["END"], "cache_keep": 300.0, "token_ids": True}


async def test_the_stream_sends_anthropics_events_in_order() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM, prompt_tokens=10)})
    async with pool(fakes) as (client, sdk):
        raw = await client.post("/v1/messages", json={"model": "smol", "max_tokens": 5, "stream": True,
                                                      "messages": [{"role": "user", "content": "Hi"}]},
                                headers={"anthropic-version": "2023-06-01"})
        async with sdk.messages.stream(model="smol", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]) as s:
            text = "".join([piece async for piece in s.text_stream])
            final = await s.get_final_message()
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = events_of(raw.text)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "content_block_delta", "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 10
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert [d["delta"] for _, d in events[3:6]] == [{"type": "text_delta", "text": t} for t in ("He", "llo", "!")]
    assert events[7][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[7][1]["usage"]["output_tokens"] == 3
    assert text == "Hello!" and final.stop_reason == "end_turn" and final.usage.output_tokens == 3


async def test_an_answer_cut_by_max_tokens_says_so() -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, "Hi"), done(n=1, reason="length")])})
    async with pool(fakes) as (_, sdk):
        message = await sdk.messages.create(model="smol", max_tokens=1, messages=[{"role": "user", "content": "x"}])
        async with sdk.messages.stream(model="smol", max_tokens=128_000, messages=[{"role": "user", "content": "x"}]) as s:
            huge = await s.get_final_message()
    assert message.stop_reason == "max_tokens" and huge.stop_reason == "max_tokens"
    assert sent(fakes)["max_tokens"] == 32_768  # Claude Code's 128,000 is held to the pool's bound


@pytest.mark.parametrize("stream", [False, True])
async def test_cache_read_is_the_prompt_the_worker_reused(stream: bool) -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, "ok"), done(prompt=100, cached=64, n=1)], prompt_tokens=100)})
    async with pool(fakes) as (_, sdk):
        if stream:
            async with sdk.messages.stream(model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s:
                usage = (await s.get_final_message()).usage
        else:
            usage = (await sdk.messages.create(model="smol", max_tokens=5,
                                               messages=[{"role": "user", "content": "x"}])).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (36, 64, 0)


async def test_count_tokens_asks_a_worker_for_the_templated_prompt() -> None:
    seen: list[dict[str, Any]] = []

    def tokenizer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 17, "max_model_len": 512, "tokens": list(range(17)),
                                         "token_strs": None})

    async with pool(FakeWorkers({"w1": tokenizer})) as (_, sdk):
        counted = await sdk.messages.count_tokens(model="smol", system="Be brief.", tools=[WEATHER],  # type: ignore[list-item]
                                                  messages=[{"role": "user", "content": "Hello world"}])
    assert counted.input_tokens == 17
    assert seen[0]["model"] == "smol" and seen[0]["add_special"] is False
    system, user = seen[0]["messages"]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n") and "get_weather" in system["content"]
    assert user == {"role": "user", "content": "Hello world", "tool_calls": []}


async def test_a_tool_call_round_trip() -> None:
    fakes = FakeWorkers({"w1": streaming([*pieces(CALL), done(n=12)])})
    async with pool(fakes) as (client, sdk):
        message = await sdk.messages.create(model="smol", max_tokens=50, tools=[WEATHER],  # type: ignore[list-item]
                                            messages=[{"role": "user", "content": "Weather in Paris?"}])
        offered = sent(fakes)["tools"]
        raw = await client.post("/v1/messages", json={
            "model": "smol", "max_tokens": 50, "stream": True, "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]})
        required = sent(fakes)["tools"]
        call = message.content[0]
        assert call.type == "tool_use"
        fakes.behaviours["w1"] = streaming(STREAM)
        answer = await sdk.messages.create(model="smol", max_tokens=50, tools=[WEATHER], messages=[  # type: ignore[list-item]
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 25 C"},
                                         {"type": "text", "text": "And tomorrow?"}]}])
    assert message.stop_reason == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert offered == {"functions": [{"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER["input_schema"]}], "choice": "auto", "parallel": True}
    assert (required["choice"], required["parallel"]) == ("required", False)
    events = events_of(raw.text)
    assert [name for name, _ in events][:3] == ["message_start", "ping", "content_block_start"]
    block = events[2][1]["content_block"]
    assert block["id"].startswith("toolu_") and block["id"] != call.id  # each request's calls have their own ids
    assert block == {"type": "tool_use", "id": block["id"], "name": "get_weather", "input": {}}
    streamed = "".join(d["delta"]["partial_json"] for name, d in events if name == "content_block_delta")
    assert json.loads(streamed) == {"city": "Paris"}
    assert next(d for name, d in events if name == "message_delta")["delta"]["stop_reason"] == "tool_use"
    assert [b.text for b in answer.content if b.type == "text"] == ["Hello!"]
    assert sent(fakes)["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]},
        {"role": "tool", "content": "Sunny, 25 C", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?"}]


async def test_tool_choice_names_a_tool_or_none() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk):
        await sdk.messages.create(model="smol", max_tokens=5, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
                                  messages=[{"role": "user", "content": "x"}])
        named = sent(fakes)["tools"]["choice"]
        message = await sdk.messages.create(model="smol", max_tokens=5, tools=[WEATHER], tool_choice={"type": "none"},  # type: ignore[list-item]
                                            messages=[{"role": "user", "content": "x"}])
    assert named == "get_weather" and sent(fakes)["tools"]["choice"] == "none"
    assert message.content[0].type == "text"


async def test_thinking_and_claude_codes_beta_fields_are_accepted() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _):
        answer = await client.post("/v1/messages", json={
            "model": "smol", "max_tokens": 32000, "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                           {"type": "text", "text": "Hello"}]},
                         {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": "Again"}]})
    assert answer.status_code == 200, answer.text
    assert sent(fakes)["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                       {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_enabled_is_served_without_thinking(stream: bool) -> None:
    """The served models have no thinking switch: `thinking` reaches no worker and no thinking block comes back."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    ask: dict[str, Any] = {"model": "smol", "max_tokens": 100, "messages": [{"role": "user", "content": "2+2?"}]}
    async with pool(fakes) as (_, sdk):
        await sdk.messages.create(**ask)
        plain = sent(fakes)
        if stream:
            async with sdk.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 50}) as s:
                kinds = [event.content_block.type async for event in s if event.type == "content_block_start"]
                message = await s.get_final_message()
        else:
            message = await sdk.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 50})
            kinds = [block.type for block in message.content]
    assert kinds == ["text"] and message.content[0].type == "text" and message.content[0].text == "Hello!"
    assert sent(fakes) == plain  # nothing of `thinking` reaches the worker


def refused(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    return message


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]}, "hologram"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "image input is not supported"),
    ({"messages": [{"role": "user", "content": "x"},  # an image in a tool's result (llama.cpp's suite sends one)
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                       {"type": "text", "text": "File: a.png"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}]},
     "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "answers no tool_use"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "type": "web_search_20250305"}]}, "server tool"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "no tools"),
])
async def test_bad_input_gets_anthropics_error_and_reaches_no_worker(body: dict[str, Any], named: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    payload = {k: v for k, v in {"model": "smol", "max_tokens": 5, **body}.items() if v is not None}
    async with pool(fakes) as (client, sdk):
        answer = await client.post("/v1/messages", json=payload)
        if "max_tokens" in payload:  # the SDK itself needs one
            with pytest.raises(anthropic.BadRequestError):
                await sdk.messages.create(**payload)
    assert named in refused(answer, 400, "invalid_request_error")
    assert fakes.calls == []


async def test_refusals_keep_their_status_with_anthropics_types() -> None:
    fakes = FakeWorkers({"w1": fake.refusing(503, "kv_full", retry_after=2)})
    async with pool(fakes) as (client, sdk):
        busy = await client.post("/v1/messages", json={"model": "smol", "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "x"}]})
        unknown = await client.post("/v1/messages", json={"model": "nope", "max_tokens": 5,
                                                          "messages": [{"role": "user", "content": "x"}]})
        with pytest.raises(anthropic.NotFoundError):
            await sdk.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        fakes.behaviours["w1"] = fake.refusing(413, "prompt_too_long")
        long = await client.post("/v1/messages", json={"model": "smol", "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "x"}]})
        missing = await client.post("/v1/messages/batches", json={})
    refused(busy, 503, "overloaded_error")
    assert busy.headers["retry-after"]
    refused(unknown, 404, "not_found_error")
    assert refused(long, 400, "invalid_request_error").startswith("prompt is too long: ")
    refused(missing, 404, "not_found_error")


async def test_an_error_after_the_start_ends_the_stream_with_an_error_event() -> None:
    broken = sse("error", {"error": "the engine failed", "reason": "engine_failed", "request_id": "r", "finished": True})
    fakes = FakeWorkers({"w1": streaming([token(0, "He"), broken])})
    async with pool(fakes) as (client, sdk):
        raw = await client.post("/v1/messages", json={"model": "smol", "max_tokens": 5, "stream": True,
                                                      "messages": [{"role": "user", "content": "x"}]})
        with pytest.raises(anthropic.APIStatusError):
            async with sdk.messages.stream(model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s:
                await s.get_final_message()
    events = events_of(raw.text)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}})


async def test_with_api_keys_x_api_key_lets_a_client_in() -> None:
    settings = Settings(heartbeat_interval=1.0, queue_size=0, api_keys="sk-right")
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, settings, api_key="sk-right") as (client, sdk):
        message = await sdk.messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        keyless = await client.post("/v1/messages", json={"model": "smol", "max_tokens": 5,
                                                          "messages": [{"role": "user", "content": "x"}]})
        counted = await client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "x"}]})
        wrong = sdk_for(client._transport.app, "sk-wrong")  # type: ignore[attr-defined]
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        await wrong.close()
    assert message.content[0].type == "text"
    refused(keyless, 401, "authentication_error")
    refused(counted, 401, "authentication_error")
    assert len(fakes.calls) == 1


async def test_a_breakpoints_longest_ttl_is_kept_and_an_unknown_ttl_is_refused() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    ask: dict[str, Any] = {"model": "smol", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    async with pool(fakes) as (client, _):
        plain = await client.post("/v1/messages", json=ask)
        assert plain.status_code == 200 and "cache_keep" not in sent(fakes)
        assert plain.json()["usage"]["input_tokens"] == 10 and plain.json()["usage"]["cache_creation_input_tokens"] == 0
        marked = await client.post("/v1/messages", json={**ask, "tools": [
            {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]})
        assert marked.status_code == 200 and sent(fakes)["cache_keep"] == 3600.0
        bad = await client.post("/v1/messages", json={**ask, "system": [
            {"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "ttl" in bad.json()["error"]["message"]
