"""The Responses WebSocket (`/v1/responses` upgraded) in-process: Starlette's TestClient over the app,
fake workers behind it. Each server message is checked against the pool's own types and the official
`openai` package's (`ResponseStreamEvent`, as `client.responses.connect()` parses them)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from coordinator.surfaces.responses_chains import Chains
from protocol import openai_responses as rs
from tests.coordinator.fakes import Behaviour, FakeWorkers, admitted, heartbeat, streaming, token
from tests.coordinator.fakes import done as done_event

SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0)
STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done_event(n=3)]
SDK_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


@contextmanager
def pool(fakes: FakeWorkers, settings: Settings = SETTINGS) -> Iterator[TestClient]:
    clock = ManualClock()
    app = create_app(settings, clock=clock, worker_client=fakes.client())
    with TestClient(app, base_url="http://coord") as client:
        beat = heartbeat("w1", timestamp=clock.time(), aliases=("smollm2",))
        assert client.post("/coordinator/health/heartbeat", content=beat.model_dump_json()).status_code == 200
        yield client


def until_final(ws: Any) -> list[dict[str, Any]]:
    """The server's messages up to a response's final event (or an error event)."""
    events = []
    while True:
        event = json.loads(ws.receive_text())
        events.append(event)
        if event["type"] in rs.TERMINAL_EVENTS or event["type"] == rs.ERROR_EVENT:
            return events


def worker_messages(fakes: FakeWorkers, i: int = -1) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = json.loads(fakes.calls[i][1].content)["messages"]
    return messages


def test_two_turns_on_one_socket_the_second_continuing_the_first() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "model": "smol", "instructions": "Be brief.", "store": False,
                      "input": [{"role": "user", "content": "Hi"}]})
        first = until_final(ws)
        ws.send_json({"type": "response.create", "model": "smol", "instructions": "Be brief.",
                      "previous_response_id": first[-1]["response"]["id"], "input": "And again?"})
        second = until_final(ws)
    for event in first + second:
        SDK_EVENT.validate_python(event)
    assert [e["type"] for e in first][:2] == [rs.CREATED, rs.IN_PROGRESS]
    assert first[-1]["type"] == second[-1]["type"] == rs.COMPLETED
    assert "".join(e["delta"] for e in first if e["type"] == rs.OUTPUT_TEXT_DELTA) == "Hello!"
    assert second[-1]["response"]["previous_response_id"] == first[-1]["response"]["id"]
    assert first[-1]["response"]["id"] != second[-1]["response"]["id"]
    # The second turn's prompt is the first's, its answer, then the new input: the worker's prefix cache
    # holds the first part.
    assert worker_messages(fakes, 0) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert worker_messages(fakes, 1) == [*worker_messages(fakes, 0), {"role": "assistant", "content": "Hello!"},
                                         {"role": "user", "content": "And again?"}]


def test_generate_false_records_a_response_to_continue_without_asking_a_worker() -> None:
    """What Codex CLI sends first on a socket: its whole prompt, `generate: false`."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "model": "smol", "generate": False, "input": "Hi"})
        warm = until_final(ws)
        assert fakes.calls == []
        ws.send_json({"type": "response.create", "model": "smol", "previous_response_id": warm[-1]["response"]["id"],
                      "input": []})
        turn = until_final(ws)
    assert [e["type"] for e in warm] == [rs.CREATED, rs.COMPLETED] and warm[-1]["response"]["output"] == []
    assert turn[-1]["type"] == rs.COMPLETED
    assert worker_messages(fakes) == [{"role": "user", "content": "Hi"}]


def test_an_unknown_previous_response_gets_openais_not_found_and_the_socket_goes_on() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "previous_response_id": "resp_nowhere", "input": "Hi"})
        refused = json.loads(ws.receive_text())
        ws.send_json({"type": "response.create", "input": "Hi"})
        served = until_final(ws)
    assert refused["type"] == "error" and refused["status"] == 400
    assert (refused["error"]["code"], refused["error"]["param"]) == ("previous_response_not_found",
                                                                     "previous_response_id")
    assert served[-1]["type"] == rs.COMPLETED and len(fakes.calls) == 1


def test_a_failed_continuation_forgets_the_chain_it_continued() -> None:
    """The socket's own chain, of a response not stored (store: false)."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "input": "Hi", "store": False})
        first = until_final(ws)[-1]["response"]["id"]
        ws.send_json({"type": "response.create", "previous_response_id": first, "input": "x", "temperature": -1})
        bad = json.loads(ws.receive_text())
        ws.send_json({"type": "response.create", "previous_response_id": first, "input": "x"})
        gone = json.loads(ws.receive_text())
    assert (bad["type"], bad["error"]["param"]) == ("error", "temperature")
    assert gone["error"]["code"] == "previous_response_not_found"


def test_a_continuation_answering_no_call_fails_and_its_chain_is_forgotten() -> None:
    """Open Responses' eviction check: a function_call_output for a call the chain never made."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "input": "Hi", "store": False})
        first = until_final(ws)[-1]["response"]["id"]
        ws.send_json({"type": "response.create", "previous_response_id": first, "store": False, "input": [
            {"type": "function_call_output", "call_id": "call_missing", "output": "64 degrees"}]})
        bad = json.loads(ws.receive_text())
        ws.send_json({"type": "response.create", "previous_response_id": first, "store": False, "input": "x"})
        gone = json.loads(ws.receive_text())
    assert (bad["type"], bad["status"], bad["error"]["param"]) == ("error", 400, "input.2.call_id")
    assert gone["error"]["code"] == "previous_response_not_found"
    assert len(fakes.calls) == 1


def test_a_stored_response_continues_on_another_socket_and_over_http() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client:
        with client.websocket_connect("/v1/responses") as ws:
            ws.send_json({"type": "response.create", "input": "Hi"})
            first = until_final(ws)[-1]["response"]
        with client.websocket_connect("/v1/responses") as ws:
            ws.send_json({"type": "response.create", "previous_response_id": first["id"], "input": "And again?"})
            second = until_final(ws)[-1]["response"]
        third = client.post("/v1/responses", json={"previous_response_id": second["id"], "input": "Once more"})
    assert first["store"] is True and second["previous_response_id"] == first["id"]
    assert third.status_code == 200 and third.json()["previous_response_id"] == second["id"]
    assert [m["content"] for m in worker_messages(fakes, 2)] == ["Hi", "Hello!", "And again?", "Hello!", "Once more"]


@pytest.mark.parametrize(("message", "code", "status"), [
    ("not json {", "invalid_request", 400),
    ("[1, 2]", "invalid_request", 400),
    (json.dumps({"type": "response.cancel"}), "invalid_request", 400),
    (json.dumps({"type": "response.create", "input": "x" * 5000}), "body_too_large", 413),
])
def test_bad_messages_get_an_error_event_naming_the_problem(message: str, code: str, status: int) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = SETTINGS.model_copy(update={"responses_socket_message_bytes": 4096})
    with pool(fakes, settings) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_text(message)
        refused = json.loads(ws.receive_text())
        ws.send_json({"type": "response.create", "input": "Hi"})  # nothing lost: the socket goes on
        served = until_final(ws)
    assert (refused["type"], refused["status"], refused["error"]["code"]) == ("error", status, code)
    assert refused["error"]["message"]
    assert served[-1]["type"] == rs.COMPLETED and len(fakes.calls) == 1


def held(release: threading.Event) -> Behaviour:
    """A worker that streams its first token, then waits (5 s at most) for `release` to finish."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield admitted()
            yield token(0, "He")
            for _ in range(500):
                if release.is_set():
                    break
                await asyncio.sleep(0.01)
            yield token(1, "llo")
            yield done_event(n=2)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return behaviour


def test_a_second_create_while_one_runs_gets_an_error() -> None:
    release = threading.Event()
    fakes = FakeWorkers({"w1": held(release)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "input": "Hi"})
        while json.loads(ws.receive_text())["type"] != rs.OUTPUT_TEXT_DELTA:
            pass
        ws.send_json({"type": "response.create", "input": "Hi again"})
        refusal = json.loads(ws.receive_text())
        release.set()
        events = until_final(ws)
    assert refusal["error"]["code"] == "response_in_flight" and refusal["status"] == 409
    assert events[-1]["type"] == rs.COMPLETED and len(fakes.calls) == 1


def test_a_turn_sent_on_the_final_event_continues_while_the_first_still_winds_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client may send its next turn the moment it reads a final event, while the first response's
    ending (its release and accounting) still runs: the turn finds its chain and waits, no refusal."""
    from coordinator.relay.socket import SocketStream
    from coordinator.surfaces import responses_socket

    class SlowEnding(SocketStream):
        async def __call__(self, *args: Any) -> None:
            await super().__call__(*args)
            await asyncio.sleep(0.3)  # the ending after the final event went out, drawn out

    monkeypatch.setattr(responses_socket, "SocketStream", SlowEnding)
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    with pool(fakes) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "model": "smol", "input": "Hi", "store": False})
        first = until_final(ws)
        ws.send_json({"type": "response.create", "model": "smol", "input": "And again?",
                      "previous_response_id": first[-1]["response"]["id"]})
        second = until_final(ws)
    assert second[-1]["type"] == rs.COMPLETED, second[-1]
    assert second[-1]["response"]["previous_response_id"] == first[-1]["response"]["id"]


def test_api_keys_are_checked_on_the_handshake() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = SETTINGS.model_copy(update={"api_keys": "sk-good"})
    with pool(fakes, settings) as client:
        with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect("/v1/responses"):
            pass
        with pytest.raises(WebSocketDenialResponse), client.websocket_connect(
                "/v1/responses", headers={"authorization": "Bearer sk-bad"}):
            pass
        with client.websocket_connect("/responses", headers={"authorization": "Bearer sk-good"}) as ws:
            ws.send_json({"type": "response.create", "input": "Hi"})
            served = until_final(ws)
    assert denied.value.status_code == 401
    assert denied.value.json()["error"]["code"] == "unauthorized"
    assert served[-1]["type"] == rs.COMPLETED


def test_sockets_past_the_bound_are_refused_and_a_closed_one_frees_its_place() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = SETTINGS.model_copy(update={"responses_sockets": 1})
    with pool(fakes, settings) as client:
        with client.websocket_connect("/v1/responses"), pytest.raises(WebSocketDenialResponse) as full, \
                client.websocket_connect("/v1/responses"):
            pass
        with client.websocket_connect("/v1/responses") as ws:
            ws.send_json({"type": "response.create", "input": "Hi"})
            assert until_final(ws)[-1]["type"] == rs.COMPLETED
    assert full.value.status_code == 503 and full.value.json()["error"]["code"] == "streams_full"


def test_an_idle_socket_is_closed() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    settings = SETTINGS.model_copy(update={"responses_socket_idle": 0.2})
    with pool(fakes, settings) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "input": "Hi"})
        assert until_final(ws)[-1]["type"] == rs.COMPLETED
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
    assert closed.value.code == 1001


def test_chains_keep_within_their_bounds_the_newest_first() -> None:
    chains = Chains(max_items=5, max_bytes=10_000)
    chains.keep("a", ({"n": 1}, {"n": 2}))
    chains.keep("b", ({"n": 1}, {"n": 2}, {"n": 3}))
    assert (chains.get("a"), len(chains)) == (({"n": 1}, {"n": 2}), 2)
    chains.keep("c", ({"n": 4},))  # 6 items: the oldest goes
    assert chains.get("a") is None and chains.get("b") is not None and chains.size[0] == 4
    chains.keep("huge", tuple({"n": i} for i in range(6)))  # over the bound alone: not kept, nothing lost
    assert chains.get("huge") is None and len(chains) == 2
    small = Chains(max_items=100, max_bytes=30)
    small.keep("a", ({"text": "x" * 10},))
    small.keep("b", ({"text": "y" * 10},))
    assert small.get("a") is None and small.get("b") is not None and small.size[1] <= 30
    chains.forget("b")
    assert chains.size == (1, len('[{"n":4}]'))
