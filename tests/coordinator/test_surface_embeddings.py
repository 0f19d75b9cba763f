"""`POST /v1/embeddings` in-process: fake workers behind httpx.MockTransport, the official `openai`
client over an ASGI transport, and raw HTTP where the wire itself is the point."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from coordinator.app import create_app
from coordinator.auth import own_tenant
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol.health import EmbeddingService
from protocol.worker import PROTOCOL_VERSION
from tests.coordinator.fakes import FakeWorkers, embedding_service, heartbeat, refusing, register

pytestmark = pytest.mark.anyio
SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0, embedding_max_inputs=4,
                    embedding_max_bytes=64)
DIMS = 4


def vector_of(text: str) -> np.ndarray:
    """What the fake workers embed `text` into: a unit vector that says which text it was."""
    v = np.array([len(text), sum(map(ord, text)) % 97, 1.0, 0.5])
    return (v / np.linalg.norm(v)).astype("<f4")


def embedding(worker_id: str = "w1", *, gate: asyncio.Event | None = None) -> Callable[[httpx.Request], Any]:
    """A worker's /worker/embed: one vector per input (`vector_of`) and 2 tokens per character of
    each input (so usage is checkable); `gate`, when given, holds the body until it is set."""

    def answer(request: httpx.Request) -> bytes:
        assert request.url.path == "/worker/embed" and request.headers["x-llm-pool-protocol"] == str(PROTOCOL_VERSION)
        body = json.loads(request.content)
        return json.dumps({
            "model": "smol", "dimensions": DIMS, "request_id": request.headers["x-request-id"],
            "worker_id": worker_id, "prompt_tokens": [2 * len(t) for t in body["inputs"]],
            "embeddings": [base64.b64encode(vector_of(t).tobytes()).decode() for t in body["inputs"]]}).encode()

    def behaviour(request: httpx.Request) -> httpx.Response:
        if gate is None:
            return httpx.Response(200, headers={"content-type": "application/json"}, content=answer(request))

        async def held() -> AsyncIterator[bytes]:
            await gate.wait()
            yield answer(request)

        return httpx.Response(200, headers={"content-type": "application/json"}, content=held())

    return behaviour


@asynccontextmanager
async def pool(fakes: FakeWorkers, *beats: tuple[str, EmbeddingService | None], settings: Settings = SETTINGS,
               api_key: str = "none") -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI]]:
    clock = ManualClock()
    app = create_app(settings, clock=clock, worker_client=fakes.client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://coord") as client:
        for worker_id, service in beats:
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time(), embeddings=service))
                    ).status_code == 200
        sdk = openai.AsyncOpenAI(base_url="http://coord/v1", api_key=api_key, max_retries=0,
                                 http_client=httpx.AsyncClient(transport=transport, base_url="http://coord"))
        try:
            yield client, sdk
        finally:
            await sdk.close()


EMBEDS = ("w1", embedding_service(DIMS))


def sent(fakes: FakeWorkers, i: int = -1) -> dict[str, Any]:
    return json.loads(fakes.calls[i][1].content)  # type: ignore[no-any-return]


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_a_string_through_the_sdk_default_base64_decoded_by_it() -> None:
    fakes = FakeWorkers({"w1": embedding()})
    async with pool(fakes, EMBEDS) as (client, sdk):
        answer = await sdk.embeddings.create(model="smol", input="hello world")
        assert await metric(client, "coordinator_embedding_requests_total") == 1
        assert await metric(client, "coordinator_embedding_inputs_total") == 1
        assert await metric(client, "coordinator_embedding_tokens_total") == 22
    assert len(answer.data) == 1 and answer.data[0].index == 0 and answer.model == "smol"
    assert np.allclose(answer.data[0].embedding, vector_of("hello world"), atol=1e-7)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (22, 22)
    assert sent(fakes) == {"inputs": ["hello world"], "model": "smol"}  # only what the client set


async def test_a_list_keeps_its_order_and_float_equals_base64() -> None:
    fakes = FakeWorkers({"w1": embedding()})
    texts = ["first", "the second one", "3rd", "first"]
    async with pool(fakes, EMBEDS) as (client, sdk):
        floats = await sdk.embeddings.create(model="smol", input=texts, encoding_format="float")
        raw = (await client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})).json()
    assert [d.index for d in floats.data] == [0, 1, 2, 3]
    for text, item, coded in zip(texts, floats.data, raw["data"], strict=True):
        assert np.allclose(item.embedding, vector_of(text), atol=1e-7)
        assert isinstance(coded["embedding"], str)
        assert np.array_equal(np.frombuffer(base64.b64decode(coded["embedding"]), dtype="<f4"),
                              np.asarray(item.embedding, dtype="<f4"))
    assert floats.data[0].embedding == floats.data[3].embedding
    assert raw["object"] == "list" and raw["usage"] == {"prompt_tokens": 2 * sum(map(len, texts)),
                                                        "total_tokens": 2 * sum(map(len, texts))}


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "at least one"),
    ({"input": ["a", ""]}, "input", "input.1"),
    ({"input": [1, 2, 3]}, "input", "token ids"),
    ({"input": [[1, 2], [3]]}, "input", "token ids"),
    ({"input": ["a", 1]}, "input", "a string or a list"),
    ({"input": 5}, "input", "a string or a list"),
    ({"input": ["a"] * 5}, "input", "EMBEDDING_MAX_INPUTS=4"),
    ({"input": ["x" * 40, "y" * 25]}, "input", "EMBEDDING_MAX_BYTES=64"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": "a", "dimensions": "4"}, "dimensions", "dimensions"),
    ({"input": "a", "dimensions": 3}, "dimensions", "only size"),
    ({}, "input", "a string or a list"),
])
async def test_refusals_name_the_field_and_reach_no_worker(body: dict[str, Any], param: str, says: str) -> None:
    fakes = FakeWorkers({"w1": embedding()})
    async with pool(fakes, EMBEDS) as (client, _):
        response = await client.post("/v1/embeddings", json={"model": "smol", **body})
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_request", "invalid_request_error")
    assert says in error["message"] and fakes.calls == []


async def test_the_models_own_size_is_accepted_and_sent_on() -> None:
    fakes = FakeWorkers({"w1": embedding()})
    async with pool(fakes, EMBEDS) as (_, sdk):
        answer = await sdk.embeddings.create(model="smol", input="a", dimensions=DIMS, user="someone")
    assert len(answer.data[0].embedding) == DIMS and sent(fakes)["dimensions"] == DIMS


async def test_only_workers_that_serve_embeddings_get_them() -> None:
    fakes = FakeWorkers({"gen": embedding("gen"), "w1": embedding()})
    async with pool(fakes, ("gen", None), EMBEDS) as (_, sdk):
        for _ in range(6):
            await sdk.embeddings.create(model="smol", input="x")
    assert fakes.hosts_called() == ["w1"] * 6


async def test_a_pool_where_no_worker_embeds_answers_400_embeddings_unsupported() -> None:
    fakes = FakeWorkers({"gen": embedding("gen")})
    async with pool(fakes, ("gen", None)) as (client, sdk):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.embeddings.create(model="smol", input="x")
        text = (await client.get("/metrics")).text
    assert refused.value.code == "embeddings_unsupported" and refused.value.param == "model"
    assert 'reason="embeddings_unsupported"' in text and fakes.calls == []


async def test_an_unknown_model_is_404_naming_model() -> None:
    fakes = FakeWorkers({"w1": embedding()})
    async with pool(fakes, EMBEDS) as (_, sdk):
        with pytest.raises(openai.NotFoundError) as refused:
            await sdk.embeddings.create(model="nope", input="x")
    assert refused.value.code == "unknown_model" and refused.value.param == "model"


async def test_an_input_too_long_for_the_worker_is_400_context_length_exceeded() -> None:
    fakes = FakeWorkers({"w1": refusing(413, "prompt_too_long")})
    async with pool(fakes, EMBEDS) as (_, sdk):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.embeddings.create(model="smol", input="x")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "input"
    assert fakes.hosts_called() == ["w1"]  # the client's fault: no other worker is tried


async def test_a_full_or_gone_worker_is_failed_over() -> None:
    fakes = FakeWorkers({"w1": refusing(503, "embeddings_full", retry_after=1), "w2": embedding("w2")})
    async with pool(fakes, EMBEDS, ("w2", embedding_service(DIMS))) as (client, sdk):
        answers = [await sdk.embeddings.create(model="smol", input="x") for _ in range(2)]
        failovers = await metric(client, 'coordinator_failovers_total{reason="embeddings_full"}')
    assert all(len(a.data) == 1 for a in answers)
    assert set(fakes.hosts_called()) == {"w1", "w2"} and fakes.hosts_called().count("w2") == 2
    assert failovers == fakes.hosts_called().count("w1") >= 1


async def test_a_workers_deadline_is_504_not_a_failover_and_not_a_fault() -> None:
    """Issue 33: a request past one worker's deadline was sent on to the next, where it waited as long,
    and answered 502 `worker_unavailable` though no worker had failed."""
    fakes = FakeWorkers({"w1": refusing(504, "deadline_exceeded"), "w2": refusing(504, "deadline_exceeded")})
    async with pool(fakes, EMBEDS, ("w2", embedding_service(DIMS))) as (client, sdk):
        for _ in range(4):
            with pytest.raises(openai.APIStatusError) as failed:
                await sdk.embeddings.create(model="smol", input="x")
            assert failed.value.status_code == 504 and failed.value.code == "deadline_exceeded"
        listing = (await client.get("/coordinator/health/workers")).json()["workers"]
    assert len(fakes.hosts_called()) == 4  # one worker a request: none tried after a deadline
    assert all(w["breaker"] == "closed" for w in listing)


async def test_an_unreachable_worker_alone_is_502() -> None:
    fakes = FakeWorkers({})  # w1 refuses connections
    async with pool(fakes, EMBEDS) as (_, sdk):
        with pytest.raises(openai.APIStatusError) as failed:
            await sdk.embeddings.create(model="smol", input="x")
    assert failed.value.status_code == 502 and failed.value.code == "worker_unavailable"


async def test_past_the_workers_embedding_slots_503_or_a_wait_in_the_queue() -> None:
    gate = asyncio.Event()
    fakes = FakeWorkers({"w1": embedding(gate=gate)})
    one_slot = ("w1", embedding_service(DIMS, capacity=1))
    async with pool(fakes, one_slot) as (client, _):
        held = asyncio.create_task(client.post("/v1/embeddings", json={"input": "a"}))
        while not fakes.calls:
            await asyncio.sleep(0.005)
        refused = await client.post("/v1/embeddings", json={"input": "b"})
        (listed,) = (await client.get("/coordinator/health/workers")).json()["workers"]  # what an operator sees
        assert listed["embeddings"]["capacity"] == 1 and listed["embedding_requests"] == 1
        gate.set()
        assert (await held).status_code == 200
        (listed,) = (await client.get("/coordinator/health/workers")).json()["workers"]
        assert listed["embedding_requests"] == 0
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "embeddings_full"
    assert refused.headers["retry-after"] == "3" and len(fakes.calls) == 1
    gate = asyncio.Event()
    fakes = FakeWorkers({"w1": embedding(gate=gate)})
    queued = Settings(**{**SETTINGS.model_dump(), "queue_size": 4, "queue_timeout": 5.0})
    async with pool(fakes, one_slot, settings=queued) as (client, _):
        first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "a"}))
        while not fakes.calls:
            await asyncio.sleep(0.005)
        second = asyncio.create_task(client.post("/v1/embeddings", json={"input": "b"}))
        while await metric(client, "coordinator_queue_length") != 1:
            await asyncio.sleep(0.005)
        assert len(fakes.calls) == 1  # it waits for the slot, not on the worker
        gate.set()
        assert [(await t).status_code for t in (first, second)] == [200, 200]
    assert len(fakes.calls) == 2


async def test_with_api_keys_a_key_is_needed_and_its_tenant_reaches_the_worker() -> None:
    fakes = FakeWorkers({"w1": embedding()})
    keyed = Settings(**{**SETTINGS.model_dump(), "api_keys": "the-key"})
    async with pool(fakes, EMBEDS, settings=keyed, api_key="the-key") as (client, sdk):
        anonymous = await client.post("/v1/embeddings", json={"input": "a"})
        await sdk.embeddings.create(model="smol", input="a")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthorized"
    assert sent(fakes)["tenant"] == own_tenant("the-key")


async def test_a_keys_limits_hold_for_embeddings_too() -> None:
    """Per-key limits apply to every kind of request a key sends: past `rpm=1` the second embedding
    request is 429 `rate_limited` and reaches no worker; `tpm` is charged with the inputs' tokens."""
    fakes = FakeWorkers({"w1": embedding()})
    keyed = Settings(**{**SETTINGS.model_dump(), "api_keys": "rpm-key acme rpm=1,tpm-key bravo tpm=10"})
    async with pool(fakes, EMBEDS, settings=keyed, api_key="rpm-key") as (client, sdk):
        await sdk.embeddings.create(model="smol", input="a")
        second = await client.post("/v1/embeddings", json={"input": "a"}, headers={"authorization": "Bearer rpm-key"})
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limited"
        assert len(fakes.calls) == 1
        tpm = {"authorization": "Bearer tpm-key"}
        first = await client.post("/v1/embeddings", json={"input": "twelve chars"}, headers=tpm)  # 24 tokens
        over = await client.post("/v1/embeddings", json={"input": "a"}, headers=tpm)
    assert first.status_code == 200 and over.status_code == 429 and "tokens a minute" in over.json()["error"]["message"]
    assert len(fakes.calls) == 2
