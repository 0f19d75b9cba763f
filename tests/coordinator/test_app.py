"""The whole app in-process: fake workers behind httpx.MockTransport, a manual clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from coordinator.app import create_app
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol.worker import PROTOCOL_VERSION
from tests.coordinator.fakes import (
    FakeWorkers,
    admitted,
    done,
    events_of,
    heartbeat,
    pinging,
    refusing,
    refusing_in_stream,
    register,
    running_app,
    sse,
    streaming,
    token,
)

pytestmark = pytest.mark.anyio

# No admission queue: these tests check the immediate 503s (queue_size 0); test_gateway_queue.py has the queue's.
SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)
STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done()]


async def infer(client: httpx.AsyncClient, body: dict | None = None, **kw: object) -> httpx.Response:  # type: ignore[type-arg]
    payload = json.dumps(body if body is not None else {"prompt": "hi", "max_tokens": 5})
    return await client.post("/coordinator/infer", content=payload, **kw)  # type: ignore[arg-type]


async def metric(client: httpx.AsyncClient, line_start: str) -> float:
    text = (await client.get("/metrics")).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


async def test_streams_tokens_then_done_and_releases_everything() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()))).status_code == 200
        response = await infer(client, headers={"x-request-id": "req-1"})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert (response.headers["x-request-id"], response.headers["x-worker-id"]) == ("req-1", "w1")
        assert "content-length" not in response.headers
        events = events_of(response.text)
        assert [name for name, _ in events] == ["token", "token", "token", "done"]
        assert "".join(d["token"] for n, d in events if n == "token") == "Hello!"
        sent = fakes.calls[0][1]
        assert sent.headers["x-request-id"] == "req-1"
        assert json.loads(sent.content) == {"prompt": "hi", "max_tokens": 5, "token_ids": True}  # ids: to continue it
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)
        assert await metric(client, 'coordinator_admission_decisions_total{outcome="admitted"') == 1
        assert await metric(client, 'coordinator_request_finished_total{finish_reason="stop"}') == 1
        assert await metric(client, "coordinator_generation_tokens_total") == 3
        assert await metric(client, "coordinator_time_to_first_token_seconds_count") == 1


async def test_worker_stream_split_into_tiny_reads_is_relayed_whole() -> None:
    whole = b"".join(STREAM)
    pieces = [whole[i:i + 3] for i in range(0, len(whole), 3)]
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(pieces)})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert events_of((await infer(client)).text) == events_of(whole.decode())


@pytest.mark.parametrize(("body", "field"), [
    ("{not json", "body"),
    (json.dumps({"max_tokens": 5}), "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": 0}), "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": -1}), "temperature"),
    (json.dumps({"prompt": "x", "surprise": 1}), "surprise"),
])
async def test_bad_input_is_400_naming_the_field(body: str, field: str) -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        response = await client.post("/coordinator/infer", content=body, headers={"x-request-id": "bad-1"})
        assert response.status_code == 400
        assert response.json() == {"error": response.json()["error"], "reason": "invalid_request",
                                   "request_id": "bad-1"}
        assert response.json()["error"].startswith(field)
        assert fakes.calls == []


async def test_oversized_body_is_413() -> None:
    settings = Settings(max_body_bytes=2048)
    clock, fakes = ManualClock(), FakeWorkers()
    async with running_app(settings, fakes, clock) as client:
        response = await infer(client, {"prompt": "x" * 5000})
        assert (response.status_code, response.json()["reason"]) == (413, "body_too_large")


async def test_no_workers_is_503_with_retry_after() -> None:
    async with running_app(SETTINGS, FakeWorkers(), ManualClock()) as client:
        response = await infer(client)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        body = response.json()
        assert body["reason"] == "no_workers" and body["request_id"] == response.headers["x-request-id"]
        assert await metric(client, 'coordinator_admission_decisions_total{outcome="rejected",reason="no_workers"}') == 1


async def test_unknown_model_is_404() -> None:
    clock = ManualClock()
    async with running_app(SETTINGS, FakeWorkers(), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        response = await infer(client, {"prompt": "x", "model": "llama-70b"})
        assert (response.status_code, response.json()["reason"]) == (404, "unknown_model")


async def test_full_sessions_is_503_sessions_full() -> None:
    clock = ManualClock()
    async with running_app(SETTINGS, FakeWorkers(), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        response = await infer(client)
        assert (response.status_code, response.json()["reason"]) == (503, "sessions_full")


@pytest.mark.parametrize("first", [refusing(503, "kv_full", retry_after=1), refusing_in_stream("sessions_full"),
                                   None])
async def test_fails_over_when_the_best_worker_refuses_or_is_unreachable(first: object) -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w2": streaming(STREAM, worker_id="w2")})
    if first is not None:
        fakes.behaviours["w1"] = first  # type: ignore[assignment]
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=1))
        response = await infer(client)
        assert response.status_code == 200 and response.headers["x-worker-id"] == "w2"
        assert fakes.hosts_called() == ["w1", "w2"]
        assert await metric(client, "coordinator_failovers_total") == 1
        assert (await client.get("/coordinator/health")).json()["kv_reserved_bytes"] == 0


@pytest.mark.parametrize(("hints", "expected"), [((7, None), "7"), ((None, 2), "2"), ((7, 2), "2"), ((2, 7), "2"),
                                                  ((None, None), "3")])
async def test_all_refusing_is_503_with_their_reason_and_the_soonest_retry_after_any_of_them_sent(
        hints: tuple[int | None, int | None], expected: str) -> None:
    """Before, the last worker's hint (or the coordinator's own): an order of tries decided it."""
    clock = ManualClock()
    fakes = FakeWorkers({w: refusing(503, "queue_full", retry_after=h) for w, h in zip(("w1", "w2"), hints, strict=True)})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=1))  # tried second
        response = await infer(client)
        assert fakes.hosts_called() == ["w1", "w2"]
        assert (response.status_code, response.json()["reason"]) == (503, "queue_full")
        assert response.headers["retry-after"] == expected  # SETTINGS.retry_after is 3


async def test_unreachable_is_502() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": refusing(503, "queue_full", retry_after=7), "w2": refusing(503, "queue_full")})
    async with running_app(SETTINGS, fakes, clock) as client:
        for w in ("w1", "w2"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        fakes.behaviours.clear()
        response = await infer(client)
        assert (response.status_code, response.json()["reason"]) == (502, "worker_unavailable")
        assert (await client.get("/coordinator/health")).json()["kv_reserved_bytes"] == 0


async def test_failover_attempts_are_bounded() -> None:
    clock, fakes = ManualClock(), FakeWorkers()
    async with running_app(Settings(max_failover_attempts=2, queue_size=0), fakes, clock) as client:
        for w in ("w1", "w2", "w3"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        assert (await infer(client)).status_code == 502
        assert fakes.hosts_called() == ["w1", "w2"]


@pytest.mark.parametrize(("status", "reason"), [
    (400, "invalid_request"), (404, "session_expired"), (409, "session_busy"), (413, "prompt_too_long"),
])
@pytest.mark.parametrize("in_stream", [False, True])
async def test_worker_client_errors_pass_through_without_retry(status: int, reason: str, in_stream: bool) -> None:
    """As a status, or (version 3) as an `error` event in place of `admitted`: the same answer."""
    clock = ManualClock()
    refusal = refusing_in_stream(reason) if in_stream else refusing(status, reason)
    fakes = FakeWorkers({"w1": refusal, "w2": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for w in ("w1", "w2"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        response = await infer(client, headers={"x-request-id": "pass"})
        assert response.status_code == status
        error = f"refused: {reason}" if in_stream else reason
        assert response.json() == {"error": error, "reason": reason, "request_id": "pass"}
        assert fakes.hosts_called() == ["w1"]


async def test_a_worker_refusing_our_worker_token_is_failed_over_not_passed_to_the_client() -> None:
    """Its 401 is about the coordinator's credentials, not the client's."""
    clock = ManualClock()
    fakes = FakeWorkers({"w1": refusing(401, "unauthorized"), "w2": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for w in ("w1", "w2"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        response = await infer(client)
        assert response.status_code == 200 and response.headers["x-worker-id"] == "w2"
        assert fakes.hosts_called() == ["w1", "w2"]


@pytest.mark.parametrize("chunks", [[token(0), token(1)], [token(0), b"event: tok"]])
async def test_worker_failing_mid_stream_ends_with_an_error_event(chunks: list[bytes]) -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(chunks, fail_after=True), "w2": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for w in ("w1", "w2"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        response = await infer(client, headers={"x-request-id": "mid"})
        events = events_of(response.text)
        assert response.status_code == 200 and [n for n, _ in events][-1] == "error"
        assert events[-1][1]["reason"] == "worker_failed" and events[-1][1]["request_id"] == "mid"
        assert fakes.hosts_called() == ["w1"]  # a started stream is never retried elsewhere
        assert (await client.get("/coordinator/health")).json()["kv_reserved_bytes"] == 0


async def test_stream_ending_without_done_is_an_error() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming([token(0)])})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        events = events_of((await infer(client)).text)
        assert [n for n, _ in events] == ["token", "error"]


async def test_worker_failing_before_its_first_event_is_failed_over() -> None:
    clock = ManualClock()
    error = sse("error", {"error": "boom", "reason": "engine_failed", "request_id": "x", "finished": True})
    fakes = FakeWorkers({"w1": streaming([error]), "w2": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for w in ("w1", "w2"):
            await register(client, heartbeat(w, timestamp=clock.time()))
        response = await infer(client)
        assert response.status_code == 200 and fakes.hosts_called() == ["w1", "w2"]
        assert [n for n, _ in events_of(response.text)][-1] == "done"


@pytest.mark.parametrize(("admitted_first", "reason", "breaker"), [
    (False, "queue_timeout", "closed"),  # still preparing the prompt: this request's own wait
    (True, "worker_failed", "open"),  # admitted, then no first token in time: the engine is failing
])
async def test_a_first_token_past_its_deadline_opens_the_breaker_only_when_the_worker_is_at_fault(
        admitted_first: bool, reason: str, breaker: str) -> None:
    """A worker that answers its head and pings is alive: a long wait before `admitted` is the
    request's own (its prompt, the tokenizers' queue) and never counts against the worker."""
    clock = ManualClock()
    settings = Settings(heartbeat_interval=1.0, worker_first_event_timeout=0.2, breaker_failures=1)
    fakes = FakeWorkers({"w1": pinging(admitted_first=admitted_first), "w2": streaming(STREAM, worker_id="w2")})
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=1))
        response = await infer(client)
        assert response.status_code == 200 and response.headers["x-worker-id"] == "w2"
        assert await metric(client, f'coordinator_failovers_total{{reason="{reason}"}}') == 1
        listing = (await client.get("/coordinator/health/workers")).json()["workers"]
        workers = {w["worker_id"]: w for w in listing}
        assert workers["w1"]["breaker"] == breaker


async def test_session_affinity_and_unknown_session_when_its_worker_is_gone() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM, worker_id="w2")})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time()))
        first = await infer(client, {"prompt": "hi", "session_id": "chat-1"})
        assert first.headers["x-worker-id"] == "w1"
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3, kv_reserved_bytes=900_000))
        again = await infer(client, {"prompt": "more", "session_id": "chat-1"})
        assert again.headers["x-worker-id"] == "w1"  # despite w2 being idle
        # the first turn may create the session; the second tells the worker it must already hold it
        sent = [request.headers.get("x-session-expected") for _, request in fakes.calls]
        assert sent == [None, "1"]
        other = await infer(client, {"prompt": "hi", "session_id": "chat-2"})
        assert other.headers["x-worker-id"] == "w2"
        clock.advance(7.0)  # w1 and w2 dead and removed; w2 comes back
        await register(client, heartbeat("w2", timestamp=clock.time()))
        gone = await infer(client, {"prompt": "more", "session_id": "chat-1"})
        assert (gone.status_code, gone.json()["reason"]) == (404, "unknown_session")
        fresh = await infer(client, {"prompt": "new start", "session_id": "chat-1"})  # told once, then afresh
        assert (fresh.status_code, fresh.headers["x-worker-id"]) == (200, "w2")


async def test_stale_worker_is_not_scheduled_and_dead_one_is_removed() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM, worker_id="w2")})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=2))
        clock.advance(2.0)
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=2))
        clock.advance(1.0)  # w1: 3 s without a heartbeat (3 intervals): stale
        listing = {w["worker_id"]: w for w in (await client.get("/coordinator/health/workers")).json()["workers"]}
        assert listing["w1"]["state"] == "stale" and listing["w1"]["score"] is None
        assert listing["w2"]["state"] == "alive" and listing["w2"]["score"] == pytest.approx(0.3)
        assert listing["w2"]["score_parts"] == {"session_load": pytest.approx(0.3), "kv_load": 0.0}
        assert listing["w2"]["breaker"] == "closed"
        response = await infer(client)
        assert response.headers["x-worker-id"] == "w2" and fakes.hosts_called() == ["w2"]
        clock.advance(3.0)
        workers = (await client.get("/coordinator/health/workers")).json()["workers"]
        assert [w["worker_id"] for w in workers] == ["w2"]
        assert await metric(client, 'coordinator_workers{state="stale"}') == 1


async def test_heartbeat_token_is_required_when_configured() -> None:
    clock = ManualClock()
    async with running_app(Settings(worker_token="s3cret"), FakeWorkers(), clock) as client:
        for token_ in (None, "wrong"):
            refused = await register(client, heartbeat("w1", timestamp=clock.time()), token=token_)
            assert (refused.status_code, refused.json()["reason"]) == (401, "unauthorized")
        assert (await client.get("/coordinator/health")).json()["workers"]["total"] == 0
        accepted = await register(client, heartbeat("w1", timestamp=clock.time()), token="s3cret")
        assert accepted.status_code == 200 and accepted.json()["state"] == "alive"
        assert (await client.get("/coordinator/health")).json()["workers"]["alive"] == 1


@pytest.mark.parametrize("offset", [31.0, -61.0])
async def test_heartbeat_from_the_future_or_far_past_is_400(offset: float) -> None:
    clock = ManualClock()
    async with running_app(Settings(), FakeWorkers(), clock) as client:
        response = await register(client, heartbeat("w1", timestamp=clock.time() + offset))
        assert (response.status_code, response.json()["reason"]) == (400, "invalid_request")
        assert response.json()["error"].startswith("timestamp")
        assert (await client.get("/coordinator/health")).json()["workers"]["total"] == 0


async def test_heartbeat_of_another_protocol_version_is_400() -> None:
    clock = ManualClock()
    async with running_app(Settings(), FakeWorkers(), clock) as client:
        beat = heartbeat("w1", timestamp=clock.time()).model_copy(update={"protocol": PROTOCOL_VERSION + 1})
        response = await register(client, beat)
        assert (response.status_code, response.json()["reason"]) == (400, "invalid_request")
        assert response.json()["error"].startswith("protocol")
        assert (await client.get("/coordinator/health")).json()["workers"]["total"] == 0


async def test_malformed_heartbeat_is_400() -> None:
    async with running_app(Settings(), FakeWorkers(), ManualClock()) as client:
        response = await client.post("/coordinator/health/heartbeat", content=b'{"worker_id": "w"}')
        assert response.status_code == 400 and response.json()["reason"] == "invalid_request"


async def test_unknown_route_gets_the_json_error_shape() -> None:
    async with running_app(Settings(), FakeWorkers(), ManualClock()) as client:
        response = await client.get("/nope")
        assert response.status_code == 404
        assert set(response.json()) == {"error", "reason", "request_id"}


async def test_worker_response_is_read_to_its_end_so_the_connection_is_reused() -> None:
    finished: list[bool] = []

    def worker(request: httpx.Request) -> httpx.Response:
        async def body():  # type: ignore[no-untyped-def]
            yield admitted() + b"".join(STREAM)
            yield b": trailing comment after done\r\n\r\n"
            finished.append(True)  # only reached when the coordinator reads past the done event

        return httpx.Response(200, content=body())

    clock = ManualClock()
    async with running_app(SETTINGS, FakeWorkers({"w1": worker}), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        assert [n for n, _ in events_of((await infer(client)).text)][-1] == "done"
    assert finished == [True]


async def test_two_apps_keep_separate_state_and_metrics() -> None:
    clock = ManualClock()
    async with running_app(SETTINGS, FakeWorkers(), clock) as one, running_app(SETTINGS, FakeWorkers(), clock) as two:
        await register(one, heartbeat("w1", timestamp=clock.time()))
        assert (await one.get("/coordinator/health")).json()["workers"]["alive"] == 1
        assert (await two.get("/coordinator/health")).json()["workers"]["alive"] == 0
        assert await metric(one, 'coordinator_heartbeats_total{outcome="accepted"}') == 1
        assert await metric(two, 'coordinator_heartbeats_total{outcome="accepted"}') == 0


async def test_infer_other_methods_are_405_in_the_json_error_shape() -> None:
    async with running_app(SETTINGS, FakeWorkers(), ManualClock()) as client:
        response = await client.get("/coordinator/infer")
        assert response.status_code == 405
        assert set(response.json()) == {"error", "reason", "request_id"}


async def test_an_unexpected_error_in_infer_is_a_500_in_the_json_error_shape() -> None:
    clock = ManualClock()
    app = create_app(SETTINGS, clock=clock, worker_client=FakeWorkers({"w1": streaming(STREAM)}).client())
    # Starlette re-raises after answering 500 (for the server's log); the test wants the answer.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))

        def broken(*_: object) -> None:
            raise RuntimeError("bug")

        app.state.coordinator.admission.check = broken
        response = await infer(client, headers={"x-request-id": "req-1"})
        assert response.status_code == 500
        assert response.json() == {"error": "internal error", "reason": "internal", "request_id": "req-1"}


async def test_a_flood_of_refusals_is_counted_in_full_but_logged_at_a_bounded_rate(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: every 503 wrote a line (21,748 lines in one minute of flood)."""
    settings = Settings(heartbeat_interval=1.0, queue_size=0, refusal_log_rate=5)
    async with running_app(settings, FakeWorkers({}), ManualClock()) as client:
        with caplog.at_level("INFO", logger="coordinator.requests"):
            for _ in range(50):
                assert (await infer(client)).status_code == 503
        lines = [r.getMessage() for r in caplog.records if r.name == "coordinator.requests"]
        assert len(lines) == 5  # the manual clock stands still: one burst's worth
        assert await metric(client, 'coordinator_admission_decisions_total{outcome="rejected"') == 50


async def test_past_max_streams_the_coordinator_refuses_instead_of_slowing_every_stream() -> None:
    release = asyncio.Event()

    def held(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield admitted() + token(0, "a")
            await release.wait()
            yield done()

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body())

    clock = ManualClock()
    settings = Settings(heartbeat_interval=1.0, queue_size=0, max_streams=1)
    async with running_app(settings, FakeWorkers({"w1": held}), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        first = asyncio.create_task(infer(client))
        while await metric(client, "coordinator_requests_running") < 1:
            await asyncio.sleep(0.01)
        refused = await infer(client)
        assert refused.status_code == 503 and refused.json()["reason"] == "streams_full"
        assert refused.headers["retry-after"] == "1"
        release.set()
        assert (await first).status_code == 200
        release.clear()
        release.set()
        assert (await infer(client)).status_code == 200  # the slot is free again


async def test_a_prompt_that_cannot_fit_is_refused_before_any_worker_tokenizes_it() -> None:
    """Before: four 3 MB chat bodies each cost a worker ~1.4 s of tokenizing before its 413, long enough to
    trip the read timeout and open both breakers. No token covers more bytes than the vocabulary's
    longest, so a prompt over session_max_tokens x that many bytes cannot fit: refused here, in O(1)."""
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time(), max_prompt_bytes=1_000))
        refused = await infer(client, {"prompt": "x" * 1_001, "max_tokens": 5})
        assert (refused.status_code, refused.json()["reason"]) == (413, "prompt_too_long") and fakes.calls == []
        chat = await client.post("/v1/chat/completions", json={"max_tokens": 5, "messages": [
            {"role": "user", "content": "y" * 600}, {"role": "user", "content": "z" * 600}]})
        assert chat.status_code == 400 and fakes.calls == []  # OpenAI's status for it
        assert chat.json()["error"]["code"] == "context_length_exceeded"
        assert (await infer(client, {"prompt": "x" * 1_000, "max_tokens": 5})).status_code == 200
        # A worker that reports no bound (0) lifts it: it alone can tell.
        await register(client, heartbeat("w2", timestamp=clock.time()))
        assert (await infer(client, {"prompt": "x" * 1_001, "max_tokens": 5})).status_code != 413
