"""A stream whose worker fails mid-way goes on on another worker (relay/continuation.py, placement.py):
the whole app in-process, fake workers behind httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol.seeds import choice_seed
from tests.coordinator.fakes import (
    MODEL,
    FakeWorkers,
    admitted,
    done,
    events_of,
    heartbeat,
    register,
    running_app,
    sse,
)

pytestmark = [pytest.mark.anyio, pytest.mark.unit]

SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)


def tok(index: int, text: str, ids: list[int] | None, choice: int = 0) -> bytes:
    data: dict[str, Any] = {"token": text, "index": index, "probability": 0.5, "finished": False}
    if ids is not None:
        data["ids"] = ids
    if choice:
        data["choice"] = choice
    return sse("token", data)


def error(reason: str) -> bytes:
    return sse("error", {"error": "it failed", "reason": reason, "request_id": "r", "finished": True})


Chunks = Callable[[dict[str, Any]], tuple[list[bytes], bool]]


def worker(chunks: Chunks) -> Callable[[httpx.Request], httpx.Response]:
    """A worker whose stream is `chunks(body)`: its events, and whether the connection breaks after them."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        events, breaks = chunks(json.loads(request.content))

        async def body() -> AsyncIterator[bytes]:
            yield admitted(5)
            for chunk in events:
                yield chunk
            if breaks:
                raise httpx.ReadError("connection reset", request=request)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return behaviour


def first_then_rest(first: tuple[list[bytes], bool], rest: tuple[list[bytes], bool]) -> Chunks:
    """The first request (no `generated`) gets `first`; a continuation gets `rest`."""
    return lambda body: rest if "generated" in body else first


BROKEN = ([tok(0, "He", [10]), tok(2, "llo", [11, 12])], True)  # the second event held a split character
REST = ([tok(3, " you", [13]), done(n=4, reason="length")], False)


async def stream(client: httpx.AsyncClient, clock: ManualClock, workers: tuple[str, ...],
                 body: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    for worker_id in workers:
        assert (await register(client, heartbeat(worker_id, timestamp=clock.time()))).status_code == 200
    response = await client.post("/coordinator/infer", json=body or {"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200
    return events_of(response.text)


async def metric(client: httpx.AsyncClient, line_start: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def bodies(fakes: FakeWorkers) -> list[tuple[str, dict[str, Any]]]:
    return [(host, json.loads(request.content)) for host, request in fakes.calls]


async def test_a_stream_whose_worker_breaks_goes_on_on_another_with_the_tokens_sent() -> None:
    behaviour = worker(first_then_rest(BROKEN, REST))
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        events = await stream(client, clock, ("w1", "w2"))
        assert [name for name, _ in events] == ["token", "token", "token", "done"]
        assert "".join(d["token"] for n, d in events if n == "token") == "Hello you"
        assert events[-1][1]["usage"]["completion_tokens"] == 4 and events[-1][1]["finish_reason"] == "length"
        (first_host, first), (second_host, second) = bodies(fakes)
        assert first_host != second_host  # never back to the worker that failed
        assert first["token_ids"] is True and "generated" not in first
        # The rest of the same request: the ids the client has, in order, and nothing else changed.
        assert second == {**first, "generated": [10, 11, 12]}
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)  # both reservations back
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="continued"}') == 1
        assert await metric(client, "coordinator_continuation_pause_seconds_count") == 1
        assert await metric(client, 'coordinator_request_finished_total{finish_reason="length"}') == 1
        # Charged once: its prompt when the first worker admitted it (5 tokens), not again for the rest.
        assert await metric(client, 'coordinator_tenant_tokens_total{kind="prompt"') == 5


async def test_a_worker_or_engine_failure_event_is_continued_but_a_deadline_is_not() -> None:
    for reason, continued in (("engine_failed", True), ("worker_failed", True), ("deadline_exceeded", False)):
        failing = ([tok(0, "He", [10]), error(reason)], False)
        behaviour = worker(first_then_rest(failing, REST))
        clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
        async with running_app(SETTINGS, fakes, clock) as client:
            events = await stream(client, clock, ("w1", "w2"))
        assert (events[-1][0] == "done") is continued, reason
        assert len(fakes.calls) == (2 if continued else 1)
        if not continued:
            assert events[-1][1]["reason"] == reason  # the worker's own ending, as it was


async def test_continuations_are_bounded_and_the_error_says_why() -> None:
    behaviour = worker(lambda body: BROKEN if "generated" not in body else ([tok(3, " y", [13])], True))
    settings = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0, continuations=1)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour, "w3": behaviour})
    async with running_app(settings, fakes, clock) as client:
        events = await stream(client, clock, ("w1", "w2", "w3"))
        assert [name for name, _ in events] == ["token", "token", "token", "error"]
        assert events[-1][1]["reason"] == "worker_failed"
        assert "continued 1 times already" in events[-1][1]["error"]
        assert len(fakes.calls) == 2  # the third worker was never asked
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="ended"}') == 1
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)


async def test_with_no_other_worker_the_stream_ends_with_an_error_naming_why() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": worker(first_then_rest(BROKEN, REST))})
    async with running_app(SETTINGS, fakes, clock) as client:
        events = await stream(client, clock, ("w1",))
        assert [name for name, _ in events] == ["token", "token", "error"]
        assert events[-1][1]["reason"] == "worker_failed"
        assert "no other worker could continue it" in events[-1][1]["error"]
        assert len(fakes.calls) == 1
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)


async def test_a_stream_whose_worker_sent_no_ids_is_not_continued() -> None:
    broken = ([tok(0, "He", None)], True)
    behaviour = worker(first_then_rest(broken, REST))
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        events = await stream(client, clock, ("w1", "w2"))
    assert [name for name, _ in events] == ["token", "error"] and len(fakes.calls) == 1
    assert "cannot be continued" in events[-1][1]["error"]


async def test_a_pool_without_continuations_does_not_ask_for_ids() -> None:
    behaviour = worker(first_then_rest(BROKEN, REST))
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(Settings(heartbeat_interval=1.0, queue_size=0, continuations=0), fakes, clock) as client:
        events = await stream(client, clock, ("w1", "w2"))
    assert [name for name, _ in events][-1] == "error" and len(fakes.calls) == 1
    assert "token_ids" not in bodies(fakes)[0][1]


async def test_a_sessions_first_turn_goes_on_on_another_worker_and_its_session_lives_there() -> None:
    """A kept session's first turn has its whole history in the request: continued, it starts the session
    afresh on the worker it went on on (prompt and whole answer), where its next turn goes."""
    behaviour = worker(lambda body: REST if "generated" in body else BROKEN if body["prompt"] == "hi" else
                       ([tok(0, "ok", [20]), done(n=1, reason="length")], False))
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        events = await stream(client, clock, ("w1", "w2"), {"prompt": "hi", "max_tokens": 4, "session_id": "s-1"})
        assert events[-1][0] == "done" and "".join(d["token"] for n, d in events if n == "token") == "Hello you"
        (first_host, first), (second_host, second) = bodies(fakes)
        assert second == {**first, "generated": [10, 11, 12]} and second["session_id"] == "s-1"
        turn = await client.post("/coordinator/infer", json={"prompt": "and?", "max_tokens": 1, "session_id": "s-1"})
        assert turn.status_code == 200 and events_of(turn.text)[-1][0] == "done"
        assert bodies(fakes)[2][0] == second_host != first_host  # the session lives where it went on


async def test_a_sessions_later_turn_is_not_continued_its_history_died_with_its_worker() -> None:
    turns = iter([([tok(0, "ok", [20]), done(n=1, reason="length")], False), BROKEN])
    behaviour = worker(lambda body: REST if "generated" in body else next(turns))
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        first = await stream(client, clock, ("w1", "w2"), {"prompt": "hi", "max_tokens": 4, "session_id": "s-2"})
        assert first[-1][0] == "done"
        later = await client.post("/coordinator/infer", json={"prompt": "more", "max_tokens": 4, "session_id": "s-2"})
    events = events_of(later.text)
    assert [name for name, _ in events][-1] == "error" and len(fakes.calls) == 2  # never sent elsewhere
    assert "token_ids" not in bodies(fakes)[1][1]
    assert "kept session's later turn is not continued" in events[-1][1]["error"]


def draining_worker(reached: asyncio.Event, gate: asyncio.Event) -> Callable[[httpx.Request], httpx.Response]:
    """A worker that streams two tokens, then waits for `gate` (it drains meanwhile), then four more; a
    continuation (a request with `generated`) gets REST."""

    def behaviour(request: httpx.Request) -> httpx.Response:
        if "generated" in json.loads(request.content):
            return worker(lambda _: REST)(request)

        async def stream_body() -> AsyncIterator[bytes]:
            yield admitted(5)
            yield tok(0, "He", [10])
            yield tok(1, "l", [11])
            reached.set()
            await gate.wait()
            for i in range(2, 6):
                yield tok(i, "l", [10 + i])
            yield done(n=6, reason="length")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream_body())

    return behaviour


async def test_a_stream_on_a_draining_worker_moves_to_one_with_room_and_stays_when_none_has() -> None:
    for room in (True, False):
        reached, gate = asyncio.Event(), asyncio.Event()
        behaviour = draining_worker(reached, gate)

        clock = ManualClock()
        fakes = FakeWorkers({"w1": behaviour, "w2": behaviour})
        async with running_app(SETTINGS, fakes, clock) as client:
            await register(client, heartbeat("w1", timestamp=clock.time()))
            if room:
                await register(client, heartbeat("w2", timestamp=clock.time(), sessions=4, max_sessions=4))
            answer = asyncio.create_task(client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 6}))
            await asyncio.wait_for(reached.wait(), 5)
            if room:  # w2 is free again by now
                await register(client, heartbeat("w2", timestamp=clock.time()))
            await register(client, heartbeat("w1", timestamp=clock.time(), draining=True))
            gate.set()
            events = events_of((await answer).text)
            text = "".join(d["token"] for n, d in events if n == "token")
            moves = await metric(client, 'coordinator_stream_moves_total{outcome="moved"}')
            stayed = await metric(client, 'coordinator_stream_moves_total{outcome="stayed"}')
            health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)
        if room:
            # Moved after its third token: the rest comes from w2, which was sent the three ids.
            assert text == "Hell you" and moves == 1
            # ... and told it may fetch the stream's cells from the draining worker instead of prefilling them.
            assert bodies(fakes)[1] == ("w2", {**bodies(fakes)[0][1], "generated": [10, 11, 12],
                                               "prefix_peer": "http://w1.test"})
        else:  # nowhere to go: it finishes in place, whole
            assert text == "Helllll" and moves == 0 and len(fakes.calls) == 1
            assert stayed == 1
        assert events[-1][0] == "done"


# Two choices, broken after two tokens of each: the first request gets these (each token event names its
# choice, 0 left out); each choice's continuation (n = 1, `generated` its ids) is told apart by those ids.
TWO_BROKEN = ([tok(0, "He", [10]), tok(0, "Yo", [20], choice=1), tok(1, "l", [11]), tok(1, "u", [21], choice=1)],
              True)
TWO_RESTS = {(10, 11): ([tok(3, "lo", [12, 13]), done(n=4, reason="length")], False),
             (20, 21): ([tok(2, "!", [22]), done(n=3, reason="stop")], False)}


def by_choice(rests: dict[tuple[int, ...], tuple[list[bytes], bool]], first: tuple[list[bytes], bool] = TWO_BROKEN
              ) -> Callable[[httpx.Request], httpx.Response]:
    """A worker: the first request (no `generated`) gets `first`; a choice's continuation what `rests` has
    for its ids."""
    return worker(lambda body: rests[tuple(body["generated"])] if "generated" in body else first)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, "seed": 42}


async def chat_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[dict[int, str], dict[int, str],
                                                                                list[dict[str, Any]]]:
    """A streamed chat's text and finish reason by choice index, and every chunk."""
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", ()):
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice.get("finish_reason"):
                finishes[choice["index"]] = choice["finish_reason"]
    return texts, finishes, chunks


async def test_a_stream_of_two_choices_goes_on_as_two_continuations_each_with_its_own_ids_and_seed() -> None:
    behaviour = by_choice(TWO_RESTS)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        texts, finishes, chunks = await chat_stream(client, {**CHAT, "stream_options": {"include_usage": True}})
        assert texts == {0: "Hello", 1: "You!"} and finishes == {0: "length", 1: "stop"}
        usage = chunks[-1]["usage"]  # summed, the prompt once
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 7, 12)
        (first_host, first), *continuations = bodies(fakes)
        assert first["n"] == 2 and first["token_ids"] is True and first["seed"] == 42
        sent = {tuple(body["generated"]): (host, body) for host, body in continuations}
        assert set(sent) == {(10, 11), (20, 21)}  # each choice alone, with its own ids
        assert all(host != first_host for host, _ in sent.values())
        # Choice 0 draws from the request's seed, choice 1 from the one its worker derived for it.
        assert sent[(10, 11)][1] == {**first, "n": 1, "generated": [10, 11]}
        assert sent[(20, 21)][1] == {**first, "n": 1, "generated": [20, 21], "seed": choice_seed(42, 1)}
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)  # all three reservations back
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="continued"}') == 1  # one break
        assert await metric(client, 'coordinator_request_finished_total{finish_reason="length"}') == 1


async def test_two_continued_choices_through_the_openai_client_streamed_and_whole() -> None:
    behaviour = by_choice(TWO_RESTS)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour, "w3": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2", "w3"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        # Over the app's client, which the app's context closes.
        sdk = openai.AsyncOpenAI(base_url="http://coord/v1", api_key="none", max_retries=0, http_client=client)
        whole = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  n=2, max_tokens=4, seed=42)
        assert [(c.index, c.message.content, c.finish_reason) for c in whole.choices] == [
            (0, "Hello", "length"), (1, "You!", "stop")]
        assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 7)
        texts: dict[int, str] = {}
        finishes: dict[int, str | None] = {}
        async for chunk in await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=42,
                stream=True):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        assert texts == {0: "Hello", 1: "You!"} and finishes == {0: "length", 1: "stop"}
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)
    assert len(fakes.calls) == 6  # each of the two requests: its first, and a continuation per choice


async def test_a_failing_choice_continuation_ends_the_stream_with_the_error() -> None:
    rests = {**TWO_RESTS, (20, 21): ([tok(2, "!", [22])], True)}  # choice 1's continuation breaks too
    settings = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0, continuations=1)
    behaviour = by_choice(rests)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour, "w3": behaviour})
    async with running_app(settings, fakes, clock) as client:
        for worker_id in ("w1", "w2", "w3"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        texts, finishes, chunks = await chat_stream(client, CHAT)
        assert texts[1] == "You!"  # choice 1's text up to its second break, nothing twice
        assert "continued 1 times already" in chunks[-1]["error"]["message"]
        assert 1 not in finishes  # choice 1 never ended; choice 0 may have
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="ended"}') == 1
    assert len(fakes.calls) == 3


async def test_a_second_break_continues_only_the_choices_not_ended_and_counts_once() -> None:
    """Choice 1's continuation breaks after choice 0's ended: only choice 1 goes on again, from all its ids."""
    rests = {(10, 11): ([tok(3, "lo", [12, 13]), done(n=4, reason="length")], False),
             (20, 21, 22): ([done(n=3, reason="stop")], False)}
    others = by_choice(rests)

    def behaviour(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("generated") != [20, 21]:
            return others(request)

        async def body() -> AsyncIterator[bytes]:  # a token, then it breaks once choice 0 has ended
            yield admitted(5)
            yield tok(2, "!", [22])
            await asyncio.sleep(0.3)
            raise httpx.ReadError("connection reset", request=request)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    clock, fakes = ManualClock(), FakeWorkers({w: behaviour for w in ("w1", "w2", "w3", "w4")})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2", "w3", "w4"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        texts, finishes, _ = await chat_stream(client, CHAT)
        assert texts == {0: "Hello", 1: "You!"} and finishes == {0: "length", 1: "stop"}
        generated = [body.get("generated") for _, body in bodies(fakes)]
        assert generated.count([10, 11]) == 1 and generated[-1] == [20, 21, 22]
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="continued"}') == 2
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)


async def test_a_choice_that_had_all_its_tokens_is_not_continued_and_one_may_end_at_once() -> None:
    """Choice 0 had its max_tokens (it ended: `length`); choice 1's continuation ends at once (its stop
    string was next). Unseeded: choice 1's continuation draws fresh (no seed sent)."""
    first = ([tok(0, "He", [10]), tok(0, "Yo", [20], choice=1), tok(1, "y", [11])], True)
    behaviour = by_choice({(20,): ([done(n=1, reason="stop")], False)}, first)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        body = {**CHAT, "max_tokens": 2, "stream_options": {"include_usage": True}}
        del body["seed"]
        texts, finishes, chunks = await chat_stream(client, body)
        assert texts == {0: "Hey", 1: "Yo"} and finishes == {0: "length", 1: "stop"}
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        (_, sent_first), (_, continued) = bodies(fakes)  # one continuation: choice 1's
        assert continued == {**sent_first, "n": 1, "generated": [20]} and "seed" not in continued
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)


async def test_a_choice_no_worker_takes_ends_the_stream_and_gives_the_other_back() -> None:
    """w2 has room for one sequence: one choice's continuation goes there, the other finds no room (no
    queue here): the stream ends with the error saying why, and the placed one is given back."""
    behaviour = by_choice(TWO_RESTS)
    clock, fakes = ManualClock(), FakeWorkers({"w1": behaviour, "w2": behaviour})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), max_sessions=1))
        *_, chunks = await chat_stream(client, CHAT)
        assert "no other worker could continue it" in chunks[-1]["error"]["message"]
        assert [host for host, _ in bodies(fakes)] in (["w1"], ["w1", "w2"])  # never two on w2
        health = (await client.get("/coordinator/health")).json()
        assert (health["requests_running"], health["kv_reserved_bytes"]) == (0, 0)
        assert await metric(client, 'coordinator_stream_breaks_total{outcome="ended"}') == 1


async def test_a_sessions_turn_on_a_draining_worker_stays_there_and_its_drain_hands_the_session_over() -> None:
    """A kept session's first turn is continued when its worker fails, but not moved off a draining one (with
    room elsewhere): the drain moves its session once the turn has ended, and two copies would disagree."""
    reached, gate = asyncio.Event(), asyncio.Event()
    clock, fakes = ManualClock(), FakeWorkers({"w1": draining_worker(reached, gate), "w2": draining_worker(reached, gate)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        answer = asyncio.create_task(client.post("/coordinator/infer",
                                                 json={"prompt": "hi", "max_tokens": 6, "session_id": "s-3"}))
        await asyncio.wait_for(reached.wait(), 5)
        first = fakes.calls[0][0]
        await register(client, heartbeat(first, timestamp=clock.time(), draining=True))
        gate.set()
        events = events_of((await answer).text)
        assert await metric(client, 'coordinator_stream_moves_total{outcome="moved"}') == 0
    assert "".join(d["token"] for n, d in events if n == "token") == "Helllll" and events[-1][0] == "done"
    assert len(fakes.calls) == 1
