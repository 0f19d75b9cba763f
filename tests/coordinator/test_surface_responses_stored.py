"""Stored Responses through the official `openai` package, in-process: the app over fake workers that
keep records as real workers do (tests/coordinator/fakes.py, `FakeWorkers.records`). A response is
stored by default; `previous_response_id` continues it on the worker that ran it with the stored
conversation first; `retrieve`, `input_items.list` and `delete` read it back through any coordinator;
another tenant's id names nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.surfaces.responses_stored import Settling
from protocol import openai_responses as rs
from tests.coordinator.fakes import FakeWorkers, heartbeat, register, running_app, streaming, token
from tests.coordinator.fakes import done as done_event
from tests.coordinator.test_surface_responses import (
    BROKEN,
    STREAM,
    first_turn_on_w1_then_w1_busier,
    pool,
    sent_body,
)

pytestmark = pytest.mark.anyio
KEYS = "alpha-key-1,beta-key-2"


async def test_a_response_is_stored_by_default_and_read_back_listed_and_deleted() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk, _):
        made = await sdk.responses.create(model="smol", instructions="Be brief.", input="Hi", metadata={"k": "v"})
        assert made.to_dict()["store"] is True
        got = await sdk.responses.retrieve(made.id)
        assert got.model_dump() == made.model_dump()
        items = await sdk.responses.input_items.list(made.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hi")]  # type: ignore[union-attr,index]
        deleted = await sdk.responses.with_raw_response.delete(made.id)
        assert deleted.http_response.json() == {"id": made.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError) as gone:
            await sdk.responses.retrieve(made.id)
        unstored = await sdk.responses.create(model="smol", input="Hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(unstored.id)
    assert gone.value.code == "unknown_response" and made.id in gone.value.message
    assert len(fakes.records) == 0


async def test_a_next_turn_sends_only_its_input_and_runs_where_the_first_did() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, workers=("w1", "w2")) as (client, sdk, _):
        first = await first_turn_on_w1_then_w1_busier(client, sdk)
        turn = await sdk.responses.with_raw_response.create(model="smol", instructions="Be brief.",
                                                            input="And then?", previous_response_id=first.parse().id)
        other = await client.post("/v1/responses", json={"instructions": "Be brief.", "input": "New"})
    assert turn.headers["x-worker-id"] == "w1" and other.headers["x-worker-id"] == "w2"
    assert sent_body(fakes, 1)["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And then?"}]
    second = turn.parse()
    assert second.previous_response_id == first.parse().id
    items = stored_items(fakes, second.id)
    assert [item.get("role") for item in items] == ["user", "assistant", "user", "assistant"]


def stored_items(fakes: FakeWorkers, response_id: str) -> list[dict[str, Any]]:
    """The conversation a stored record holds, read from the fake worker's store."""
    (body,) = [b for (_, _, rid), b in fakes.records.items() if rid == response_id]
    items: list[dict[str, Any]] = json.loads(body)["items"]
    return items


async def test_a_streamed_response_is_stored_before_its_end_reaches_the_client() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (_, sdk, _):
        stream = await sdk.responses.create(model="smol", input="Hi", stream=True)
        stored_at_end = None
        async for event in stream:
            if event.type == "response.completed":
                stored_at_end = any(rid == event.response.id for (_, _, rid) in fakes.records)
    assert stored_at_end is True


async def test_the_record_is_kept_before_the_bytes_that_end_the_response() -> None:
    """`Settling` in isolation (httpx's in-process transport buffers whole answers, so order is seen
    only here and in the process tests): the message written once the end is encoded waits for the
    record, and later ones do not wait again."""
    written: list[str] = []
    ended = False

    class Answer(Response):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            nonlocal ended
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"tokens", "more_body": True})
            ended = True  # the encoder has built the final event
            await send({"type": "http.response.body", "body": b"end", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def settle() -> None:
        written.append("record kept")

    async def send(message: Message) -> None:
        written.append(message.get("body", b"start").decode() or "close")

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    await Settling(Answer(), ready=lambda: ended, settle=settle)({"type": "http"}, receive, send)
    assert written == ["start", "tokens", "record kept", "end", "close"]


async def test_a_chain_resolves_through_another_coordinator() -> None:
    """Two apps over the same workers: the second never saw the first's response, asks every live
    worker, and continues it there."""
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, workers=("w1", "w2")) as (_, sdk, _):
        first = await sdk.responses.create(model="smol", input="Hi")
    async with pool(fakes, workers=("w2", "w1")) as (_, sdk, _):
        again = await sdk.responses.retrieve(first.id)
        turn = await sdk.responses.with_raw_response.create(model="smol", input="More", previous_response_id=first.id)
    assert again.id == first.id and turn.headers["x-worker-id"] == "w1"


async def test_a_draining_workers_records_move_and_their_chains_go_on() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM)})
    async with pool(fakes, workers=("w1", "w2")) as (client, sdk, _):
        first = await sdk.responses.with_raw_response.create(model="smol", input="Hi")
        assert first.headers["x-worker-id"] == "w1"
        made = first.parse()
        drain = heartbeat("w1", timestamp=1_700_000_000.0, aliases=("smollm2",), draining=True)
        assert (await register(client, drain)).status_code == 200
        await wait_for(lambda: [h for h, _, _ in fakes.records] == ["w2"])
        turn = await sdk.responses.with_raw_response.create(model="smol", input="More", previous_response_id=made.id)
        assert (await sdk.responses.retrieve(made.id)).id == made.id
    assert turn.headers["x-worker-id"] == "w2"
    assert [m["content"] for m in sent_body(fakes)["messages"]] == ["Hi", "Hello!", "More"]


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_unknown_or_another_tenants_response_is_not_found() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, api_keys=KEYS)
    clock = ManualClock()
    async with running_app(settings, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time(), aliases=("smollm2",)))).status_code == 200
        alpha, beta = ({"authorization": f"Bearer {key}"} for key in KEYS.split(","))
        made = (await client.post("/v1/responses", json={"input": "Hi"}, headers=alpha)).json()
        calls = len(fakes.calls)
        for path in (f"/v1/responses/{made['id']}", f"/v1/responses/{made['id']}/input_items"):
            read = await client.get(path, headers=beta)
            assert (read.status_code, read.json()["error"]["code"]) == (404, "unknown_response"), path
        assert (await client.delete(f"/v1/responses/{made['id']}", headers=beta)).status_code == 404
        for previous in (made["id"], "resp_never", "not an id"):
            turn = await client.post("/v1/responses", json={"input": "More", "previous_response_id": previous},
                                     headers=beta)
            error = turn.json()["error"]
            assert (turn.status_code, error["code"], error["param"]) == (
                400, rs.PREVIOUS_NOT_FOUND, "previous_response_id"), previous
        assert len(fakes.calls) == calls  # nothing reached a worker's generate
        assert (await client.get(f"/v1/responses/{made['id']}", headers=alpha)).status_code == 200


async def test_a_failed_response_is_not_stored() -> None:
    broken = [token(0, "He"), BROKEN[1]]
    fakes = FakeWorkers({"w1": streaming(broken)})
    async with pool(fakes) as (client, _, _):
        failed = await client.post("/v1/responses", json={"input": "Hi"})
    assert failed.status_code == 502 and fakes.records == {}


async def test_store_off_in_the_settings_keeps_nothing() -> None:
    fakes = FakeWorkers({"w1": streaming([token(0, "x"), done_event(n=1)])})
    async with pool(fakes, Settings(heartbeat_interval=1.0, queue_size=0, responses_store=False)) as (client, _, _):
        made = (await client.post("/v1/responses", json={"input": "Hi"})).json()
        turn = await client.post("/v1/responses", json={"input": "More", "previous_response_id": made["id"]})
    assert made["store"] is False and fakes.records == {}
    assert turn.json()["error"]["code"] == rs.PREVIOUS_NOT_FOUND
