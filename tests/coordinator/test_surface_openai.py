"""The OpenAI surface in-process: fake workers behind httpx.MockTransport, and the official `openai`
client (over an ASGI transport) as well as raw HTTP where the wire itself is the point."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol import openai as oa
from protocol.health import OfferedModel
from tests.coordinator.fakes import (
    FakeWorkers,
    done,
    heartbeat,
    refusing,
    register,
    sse,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)  # 503 at once at capacity
STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done(n=3)]


@asynccontextmanager
async def pool(fakes: FakeWorkers, *beats: tuple[str, str, tuple[str, ...]],
               settings: Settings = SETTINGS) -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI]]:
    """The app with workers registered as (worker id, model, aliases); an httpx client and an SDK client."""
    clock = ManualClock()
    app = create_app(settings, clock=clock, worker_client=fakes.client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://coord") as client:
        for worker_id, model, aliases in beats:
            hb = heartbeat(worker_id, timestamp=clock.time(), model=model, aliases=aliases)
            assert (await register(client, hb)).status_code == 200
        sdk = openai.AsyncOpenAI(base_url="http://coord/v1", api_key="none", max_retries=0,
                                 http_client=httpx.AsyncClient(transport=transport, base_url="http://coord"))
        try:
            yield client, sdk
        finally:
            await sdk.close()


ONE = ("w1", "smol", ("smollm2",))


def sent_body(fakes: FakeWorkers, i: int = -1) -> dict:  # type: ignore[type-arg]
    return json.loads(fakes.calls[i][1].content)


async def test_chat_stream_through_the_sdk_reassembles_the_text_and_reports_usage() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (_, sdk):
        stream = await sdk.chat.completions.create(
            model="smol", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            stream=True, stream_options={"include_usage": True}, max_tokens=5)
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 3)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    # The messages reach the worker as messages, for its own chat template; no logprobs were asked
    # for, so the worker is told to skip each token's probability.
    assert sent_body(fakes) == {"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}],
                                "model": "smol", "max_tokens": 5, "probabilities": False, "token_ids": True}


async def test_chat_without_stream_is_one_object_with_logprobs() -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, "Hi"), done(n=1, reason="length")])})
    async with pool(fakes, ONE) as (_, sdk):
        answer = await sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}],
                                                   logprobs=True, top_logprobs=1, max_completion_tokens=1)
    assert answer.object == "chat.completion" and answer.model == "smol"  # the alias resolves to the model
    choice = answer.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Hi", "length")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert choice.logprobs.content[0].token == "Hi"
    assert choice.logprobs.content[0].logprob == pytest.approx(-0.6931, abs=1e-3)  # the fake's p = 0.5
    assert answer.usage is not None and answer.usage.total_tokens == 6
    assert sent_body(fakes)["max_tokens"] == 1 and "probabilities" not in sent_body(fakes)  # the default: computed


async def test_completions_send_a_raw_prompt_and_stream_text_chunks() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (_, sdk):
        stream = await sdk.completions.create(model="smol", prompt="Once upon", stream=True, seed=7, stop=["\n"])
        chunks = [chunk async for chunk in stream]
        whole = await sdk.completions.create(model="smol", prompt=["Once upon"], temperature=0, logprobs=1)
    assert "".join(c.choices[0].text for c in chunks) == "Hello!"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sent_body(fakes, 0) == {"prompt": "Once upon", "raw": True, "model": "smol", "max_tokens": 16,
                                   "seed": 7, "stop": ["\n"], "probabilities": False, "token_ids": True}
    assert whole.object == "text_completion" and whole.choices[0].text == "Hello!"
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.text_offset == [0, 2, 5]
    assert sent_body(fakes, 1)["temperature"] == 0 and "probabilities" not in sent_body(fakes, 1)


async def test_wire_format_ends_with_done_and_every_chunk_parses() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
            "stream": True, "stream_options": {"include_usage": True}, "some_future_field": {"a": 1}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = [block for block in response.text.split("\n\n") if block]
    assert frames[-1] == "data: [DONE]"
    for frame in frames[:-1]:
        oa.ChatCompletionChunk.model_validate_json(frame.removeprefix("data: "))
    assert sent_body(fakes)["messages"] == [{"role": "user", "content": "Hi!"}]
    assert sent_body(fakes)["max_tokens"] == oa.MAX_COMPLETION_TOKENS  # none given: until the session's limit


async def test_an_error_after_the_first_token_is_an_error_chunk_then_done() -> None:
    broken = [token(0, "He"), sse("error", {"error": "engine failure", "reason": "engine_failed",
                                            "request_id": "r", "finished": True})]
    fakes = FakeWorkers({"w1": streaming(broken)})
    async with pool(fakes, ONE) as (client, sdk):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True})
        frames = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["error"]["code"] == "engine_failed"
        with pytest.raises(openai.APIError):
            async for _ in await sdk.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                                             stream=True):
                pass
        # Not streaming: nothing was sent yet, so the failure is a status code.
        whole = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "engine_failed"


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, 400, "n", "invalid_request"),  # past MAX_CHOICES
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2, "session_id": "s"}, 400, "n", "invalid_request"),
    ({"messages": []}, 400, "messages", "invalid_request"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role", "invalid_request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model", "unknown_model"),
    # Meaning-changing fields the pool does not implement are refused, never dropped in silence.
    *[({"messages": [{"role": "user", "content": "x"}], field: value}, 400, field, "invalid_request")
      for field, value in [
          ("tool_choice", "required"), ("typical_p", 0.5), ("min_p", 0.1), ("modalities", ["audio"]),
          ("top_logprobs", 21)]],
    *[({"messages": [{"role": "user", "content": "x"}], "keep_alive": value}, 400, "keep_alive", "invalid_request")
      for value in ("5 minutes", "m", "", "1y", 1e9, "-1e9")],
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "grammar": "root ::= \"a\""}, 400, "response_format", "invalid_request"),
])
async def test_refusals_use_openais_error_shape(body: dict, status: int, param: str, code: str) -> None:  # type: ignore[type-arg]
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "r-1"})
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]
    assert response.headers["x-request-id"] == "r-1"
    assert fakes.calls == []


async def test_unknown_model_lists_the_models_served_and_reaches_the_sdk_as_not_found() -> None:
    async with pool(FakeWorkers({}), ONE, ("w2", "gemma", ())) as (_, sdk):
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.chat.completions.create(model="tinyllama", messages=[{"role": "user", "content": "x"}])
    assert "gemma, smol" in str(caught.value)


async def test_with_any_model_name_an_unknown_name_is_served_by_the_model_and_sent_as_its_name() -> None:
    """ANY_MODEL_NAME: as llama-server serves its one model under any name; the worker, which checks the
    name itself, is sent the served one (an alias it knows is sent as it came)."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = SETTINGS.model_copy(update={"any_model_name": True})
    async with pool(fakes, ONE, settings=settings) as (client, sdk):
        chat = await sdk.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "x"}])
        assert sent_body(fakes)["model"] == "smol" and chat.choices[0].message.content == "Hello!"
        await sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}])
        assert sent_body(fakes)["model"] == "smollm2"
        listed = await client.get("/v1/models")
    assert [m["id"] for m in listed.json()["data"]] == ["smol"]  # the names it takes are not listed


async def test_models_lists_the_models_offered_from_a_folder_with_their_state() -> None:
    fakes = FakeWorkers({})
    offered = [OfferedModel(name="smol", state="loaded"), OfferedModel(name="gemma", state="offered"),
               OfferedModel(name="big", state="too_large", reason="needs 9 bytes; the budget is 8")]
    async with pool(fakes, settings=SETTINGS.model_copy(update={"model_loads": False})) as (client, sdk):
        beat = heartbeat("w1", timestamp=ManualClock().time(), model="smol").model_copy(update={"offered": offered})
        registered = await register(client, beat)
        assert registered.status_code == 200, registered.text
        listed = (await client.get("/v1/models")).json()["data"]
        one = await client.get("/v1/models/gemma")
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "x"}])
        status = (await client.get("/coordinator/health/workers")).json()
    assert [(m["id"], m["state"]) for m in listed] == [("smol", "loaded"), ("gemma", "offered")]
    assert one.status_code == 200 and one.json()["state"] == "offered"
    assert caught.value.status_code == 503 and "offered by w1" in str(caught.value)
    assert [o["state"] for o in status["workers"][0]["offered"]] == ["loaded", "offered", "too_large"]
    assert fakes.calls == []


async def test_at_capacity_the_sdk_sees_503_with_retry_after() -> None:
    fakes = FakeWorkers({"w1": refusing(503, "sessions_full", retry_after=2)})
    async with pool(fakes, ONE) as (client, sdk):
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}])
        raw = await client.post("/v1/completions", json={"prompt": "x"})
    assert caught.value.status_code == 503
    assert raw.status_code == 503 and raw.headers["retry-after"] == "2"
    assert raw.json()["error"] == {"message": "every eligible worker refused: sessions_full",
                                   "type": "server_error", "param": None, "code": "sessions_full"}


async def test_models_lists_each_model_served_with_its_aliases() -> None:
    async with pool(FakeWorkers({}), ONE, ("w2", "gemma", ("g3",)), ("w3", "smol", ())) as (client, sdk):
        listed = [m.id async for m in sdk.models.list()]
        card = await sdk.models.retrieve("g3")
        raw = (await client.get("/v1/models")).json()
        missing = await client.get("/v1/models/nope")
    assert listed == ["gemma", "smol"]
    assert card.id == "gemma"
    assert {m["id"]: m["aliases"] for m in raw["data"]} == {"gemma": ["g3"], "smol": ["smollm2"]}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_model"


async def test_requests_without_a_model_need_one_when_several_are_served_unless_a_default_is_set() -> None:
    beats = (ONE, ("w2", "gemma", ()))
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, *beats) as (client, _):
        response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400 and "gemma, smol" in response.json()["error"]["message"]
    async with pool(fakes, *beats, settings=Settings(heartbeat_interval=1.0, default_model="gemma")) as (client, _):
        response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 200 and fakes.hosts_called() == ["w2"]


async def test_each_model_goes_to_its_own_workers() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, ONE, ("w2", "gemma", ())) as (client, _):
        for model in ("gemma", "smol", "smollm2", "gemma"):
            response = await client.post("/v1/chat/completions",
                                         json={"model": model, "messages": [{"role": "user", "content": "x"}]})
            assert response.status_code == 200
    assert fakes.hosts_called() == ["w2", "w1", "w1", "w2"]


async def test_a_next_turn_goes_back_to_the_worker_that_served_the_conversation() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, ONE, ("w2", "smol", ())) as (client, _):
        history = [{"role": "user", "content": "Hi"}]
        first = await client.post("/v1/chat/completions", json={"messages": history})
        assert first.headers["x-worker-id"] == "w1"  # a tie goes to the lower id
        # Now w1 is the busier one: by score alone, everything would go to w2.
        assert (await register(client, heartbeat("w1", timestamp=1_700_000_000.0, sessions=3))).status_code == 200
        for turn in range(3):
            history += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": f"And {turn}?"}]
            response = await client.post("/v1/chat/completions", json={"messages": history})
            assert response.headers["x-worker-id"] == "w1"
        other = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "New"}]})
        assert other.headers["x-worker-id"] == "w2"
        edited = history[:-1] + [{"role": "assistant", "content": "changed"}, {"role": "user", "content": "?"}]
        assert (await client.post("/v1/chat/completions", json={"messages": edited})).headers["x-worker-id"] == "w2"


async def test_fields_with_values_that_change_nothing_are_accepted() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
            "parallel_tool_calls": True, "some_future_field": {"anything": 1}})
    assert response.status_code == 200, response.text


async def test_chat_stream_opens_with_the_role_alone_closes_with_an_empty_delta_and_has_a_fingerprint() -> None:
    """As OpenAI streams it (strict clients check both ends): before, the role rode on the first content
    chunk and the last chunk carried `delta: {"content": ""}`; `system_fingerprint` was absent. The role's
    chunk has `content: null` (llama.cpp's server suite refuses an empty content delta)."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "stream": True})
        whole = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert deltas[1:-1] == [{"content": "He"}, {"content": "llo"}, {"content": "!"}]
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert {c["system_fingerprint"] for c in chunks} == {whole.json()["system_fingerprint"]}
    assert whole.json()["system_fingerprint"].startswith("fp_")


@pytest.mark.parametrize(("extra", "sent"), [
    ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}},
     {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}),
    ({"response_format": {"type": "text"}}, {}),
    ({"grammar": 'root ::= "yes" | "no"'}, {"grammar": 'root ::= "yes" | "no"'}),
    ({"json_schema": {"type": "array"}}, {"json_schema": {"type": "array"}}),
    ({"logit_bias": {"42": -100}, "presence_penalty": 0.5, "frequency_penalty": 1},
     {"logit_bias": {"42": -100}, "presence_penalty": 0.5, "frequency_penalty": 1}),
    # Ollama's keep_alive, in seconds or as a duration.
    ({"keep_alive": 30}, {"keep_alive": 30.0}),
    ({"keep_alive": "1h30m"}, {"keep_alive": 5400.0}),
    ({"keep_alive": "-1"}, {"keep_alive": -1.0}),
    ({"keep_alive": "250ms"}, {"keep_alive": 0.25}),
])
async def test_structured_output_and_sampling_fields_reach_the_worker(extra: dict, sent: dict) -> None:  # type: ignore[type-arg]
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 200, response.text
    body = sent_body(fakes)
    keys = ("grammar", "json_schema", "logit_bias", "presence_penalty", "frequency_penalty", "keep_alive")
    assert {k: body[k] for k in keys if k in body} == sent


@pytest.mark.parametrize("stream", [False, True])
async def test_alternatives_come_from_the_worker_as_top_logprobs_on_both_routes(stream: bool) -> None:
    """top_logprobs (chat, up to 20) and logprobs (completions, up to 5) ask the worker for the most likely
    tokens at each step (`alternatives`); its `top` lists become OpenAI's shapes, whole and streamed."""
    top = [["Hi", -0.1], ["Hello", -2.5], ["Hey", -3.0]]
    event = sse("token", {"token": "Hi", "index": 0, "probability": 0.9, "finished": False, "top": top})
    fakes = FakeWorkers({"w1": streaming([event, done(n=1, reason="length")])})
    async with pool(fakes, ONE) as (_, sdk):
        chat = await sdk.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],  # type: ignore[call-overload]
                                                 logprobs=True, top_logprobs=2, max_completion_tokens=1, stream=stream)
        entries = ([e for c in [c async for c in chat] if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content or []] if stream else chat.choices[0].logprobs.content)
        assert sent_body(fakes, -1)["alternatives"] == 2
        text = await sdk.completions.create(model="smol", prompt="x", logprobs=3, max_tokens=1, stream=stream)  # type: ignore[call-overload]
        tops = ([t for c in [c async for c in text] if c.choices and c.choices[0].logprobs
                 for t in c.choices[0].logprobs.top_logprobs or []] if stream else text.choices[0].logprobs.top_logprobs)
        assert sent_body(fakes, -1)["alternatives"] == 3
    (entry,) = entries
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("Hi", -0.1), ("Hello", -2.5)]  # at most 2
    assert tops == [{"Hi": -0.1, "Hello": -2.5, "Hey": -3.0}]


async def test_the_openai_routes_answer_without_v1_as_llama_server_does_keys_and_all() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes, ONE) as (client, _):
        chat = await client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        models = await client.get("/models")
        one = await client.get("/models/smol")
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert models.json()["data"][0]["id"] == "smol" and one.json()["id"] == "smol"
    keyed = Settings(heartbeat_interval=1.0, api_keys="sk-test-1")
    async with pool(FakeWorkers({"w1": streaming(STREAM)}), ONE, settings=keyed) as (client, _):
        refused = await client.post("/completions", json={"prompt": "Hi"})
    assert refused.status_code == 401  # the same keys as on /v1/completions
