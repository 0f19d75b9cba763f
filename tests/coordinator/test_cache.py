"""The response cache: what may be cached, its bounds (entries, bytes, TTL), persistence, recovery,
and replay through the app, event for event."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest

from coordinator.cache import Replay, ResponseCache, cache_key
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol.sse import SseEvent
from protocol.worker import GenerateRequest
from tests.coordinator.fakes import (
    FakeWorkers,
    done,
    events_of,
    heartbeat,
    register,
    running_app,
    sse,
    streaming,
    token,
)


def ev(text: str) -> tuple[SseEvent, ...]:
    return (SseEvent("token", json.dumps({"token": text, "index": 0, "probability": 0.5, "finished": False})),)


@pytest.mark.parametrize(("fields", "cacheable"), [
    ({"prompt": "x", "temperature": 0}, True),
    ({"prompt": "x", "temperature": 0.7, "seed": 3}, True),
    ({"prompt": "x", "temperature": 0.7}, False),  # sampled without a seed: never the same twice
    ({"prompt": "x", "temperature": 0, "session_id": "s"}, False),  # a session's output depends on its history
])
def test_only_fully_determined_requests_have_a_key(fields: dict, cacheable: bool) -> None:  # type: ignore[type-arg]
    assert (cache_key("infer", "m", GenerateRequest.model_validate(fields)) is not None) is cacheable


def test_the_key_covers_surface_model_and_every_field() -> None:
    base = {"prompt": "x", "temperature": 0, "max_tokens": 8}
    key = cache_key("infer", "m", GenerateRequest.model_validate(base))
    for change in ({"prompt": "y"}, {"max_tokens": 9}, {"stop": ["."]}, {"top_k": 5}, {"top_p": 0.5},
                   {"ignore_eos": True}, {"raw": True}, {"n": 2}):
        assert cache_key("infer", "m", GenerateRequest.model_validate({**base, **change})) != key, change
    assert cache_key("openai-chat", "m", GenerateRequest.model_validate(base)) != key
    assert cache_key("infer", "other", GenerateRequest.model_validate(base)) != key
    assert cache_key("infer", "m", GenerateRequest.model_validate(base)) == key
    # How long the model stays loaded after changes nothing of the answer.
    assert cache_key("infer", "m", GenerateRequest.model_validate({**base, "keep_alive": 0})) == key


def test_bounded_by_entries_bytes_and_ttl() -> None:
    clock = ManualClock()
    evicted: list[int] = []
    cache = ResponseCache(entries=2, max_bytes=10_000, ttl=10, clock=clock.time, on_evict=lambda: evicted.append(1))
    for k in (b"a", b"b", b"c"):
        cache.put(k, ev(k.decode()))
    assert (cache.get(b"a"), len(cache), len(evicted)) == (None, 2, 1)  # least recently used out
    small = ResponseCache(entries=100, max_bytes=300, ttl=10, clock=clock.time)
    for k in (b"a", b"b", b"c", b"d"):
        small.put(k, ev("x" * 40))
    assert small.bytes <= 300 and small.get(b"a") is None and small.get(b"d") is not None
    small.put(b"huge", ev("x" * 1000))  # larger than the whole cache: not stored
    assert small.get(b"huge") is None
    clock.advance(11)
    assert small.get(b"d") is None  # expired
    assert not ResponseCache(entries=0, max_bytes=300, ttl=10).enabled
    big = ResponseCache(entries=10, max_bytes=100 << 20, ttl=10, clock=clock.time)
    big.put(b"long", ev("x" * (2 << 20)))  # over the per-entry bound, though the cache has room
    assert big.get(b"long") is None and big.entry_limit == 1 << 20


def test_persists_across_a_restart_and_drops_what_expired(tmp_path: Path) -> None:
    clock, path = ManualClock(), tmp_path / "cache.sqlite"
    first = ResponseCache(entries=10, max_bytes=10_000, ttl=100, clock=clock.time, path=path)
    first.put(b"old", ev("old"))
    clock.advance(60)
    first.put(b"new", ev("new"))
    first.close()
    clock.advance(50)  # "old" is 110 s old now, "new" 50 s
    second = ResponseCache(entries=10, max_bytes=10_000, ttl=100, clock=clock.time, path=path)
    assert second.get(b"new") == ev("new") and second.get(b"old") is None
    second.close()


def test_a_corrupt_file_is_moved_aside_and_a_fresh_one_started(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    path.write_bytes(b"this is not a database at all" * 100)
    cache = ResponseCache(entries=10, max_bytes=10_000, ttl=100, path=path)
    cache.put(b"k", ev("v"))
    cache.close()
    assert [p.name.split(".corrupt-")[0] for p in tmp_path.glob("cache.sqlite.corrupt-*")] == ["cache.sqlite"]
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 1


STREAM = [token(0, "Pa"), token(1, "ris"), done(n=2)]
GREEDY = {"prompt": "Capital of France?", "max_tokens": 2, "temperature": 0}


async def post(client: httpx.AsyncClient, body: dict, request_id: str) -> httpx.Response:  # type: ignore[type-arg]
    return await client.post("/coordinator/infer", content=json.dumps(body), headers={"x-request-id": request_id})


@pytest.mark.anyio
async def test_a_repeated_greedy_request_is_replayed_event_for_event_without_a_worker() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(Settings(cache_entries=100, queue_size=0), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        first = await post(client, GREEDY, "r1")
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))  # full: a hit needs no room
        again = await post(client, GREEDY, "r2")
        assert again.status_code == 200 and again.headers["x-worker-id"] == "cache"
        assert len(fakes.calls) == 1
        original, replayed = events_of(first.text), events_of(again.text)
        assert original[:-1] == replayed[:-1]  # the tokens, index and probability included
        hit = replayed[-1][1]
        assert (hit["cached"], hit["request_id"], hit["usage"]["completion_tokens"]) == (True, "r2", 0)
        assert not original[-1][1].get("cached", False)
        await register(client, heartbeat("w1", timestamp=clock.time()))
        openai = await client.post("/v1/completions", json={"prompt": "Capital of France?", "max_tokens": 2,
                                                            "temperature": 0})
        assert openai.json()["choices"][0]["text"] == "Paris" and len(fakes.calls) == 2  # its own key
        metrics = (await client.get("/metrics")).text
        assert 'coordinator_response_cache_lookups_total{outcome="hit"} 1.0' in metrics


@pytest.mark.anyio
async def test_a_model_swapped_under_the_same_name_misses_and_its_entries_go() -> None:
    """Before: cached under SmolLM2, restarted with Gemma served under the same public name, SmolLM2's
    answer came back `cached: true`. The key names the model's identity (the worker's digest of its file)."""
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(Settings(cache_entries=100, queue_size=0), fakes, clock) as client:
        cache = client._transport.app.state.coordinator.cache  # type: ignore[attr-defined]
        await register(client, heartbeat("w1", timestamp=clock.time(), model_identity="gguf:smollm2"))
        await post(client, GREEDY, "r1")
        assert (await post(client, GREEDY, "r2")).headers["x-worker-id"] == "cache" and len(cache) == 1
        await register(client, heartbeat("w1", timestamp=clock.time(), model_identity="gguf:gemma3"))
        assert len(cache) == 0  # nobody serves the old identity: its entries are dropped
        swapped = await post(client, GREEDY, "r3")
        assert swapped.headers["x-worker-id"] == "w1" and len(fakes.calls) == 2
        assert (await post(client, GREEDY, "r4")).headers["x-worker-id"] == "cache"  # the new model's own
        # The same model under new aliases is still the same model: its entries stay.
        await register(client, heartbeat("w1", timestamp=clock.time(), model_identity="gguf:gemma3",
                                         aliases=("gemma",)))
        assert len(cache) == 1 and (await post(client, GREEDY, "r5")).headers["x-worker-id"] == "cache"


@pytest.mark.anyio
async def test_after_a_restart_a_persisted_answer_of_another_model_under_the_same_name_misses(
        tmp_path: Path) -> None:
    """A restarted coordinator loads its SQLite cache before any worker reports: only the key's model
    identity keeps the old model's answers from the new one's clients."""
    settings = Settings(cache_entries=100, queue_size=0, cache_path=str(tmp_path / "cache.sqlite"))
    for identity, expected in (("gguf:smollm2", "w1"), ("gguf:smollm2", "cache"), ("gguf:gemma3", "w1")):
        clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
        async with running_app(settings, fakes, clock) as client:
            await register(client, heartbeat("w1", timestamp=clock.time(), model_identity=identity))
            assert (await post(client, GREEDY, "r")).headers["x-worker-id"] == expected, identity


@pytest.mark.anyio
async def test_sampled_requests_and_failed_streams_are_never_stored() -> None:
    broken = [token(0, "Pa"), sse("error", {"error": "boom", "reason": "engine_failed", "request_id": "r",
                                            "finished": True})]
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(broken)})
    settings = Settings(cache_entries=100, queue_size=0, breaker_failures=100)  # the failures are the point here
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        for _ in range(2):
            await post(client, GREEDY, "e")  # ended with `error`: not stored, asked again
        sampled = {**GREEDY, "temperature": 0.8}
        for _ in range(2):
            await post(client, sampled, "s")
        assert len(fakes.calls) == 4


@pytest.mark.anyio
async def test_a_replayed_answer_of_several_choices_keeps_each_ending_and_counts_nothing_computed() -> None:
    raw = json.loads(done(n=5).decode().split("data: ", 1)[1])
    raw["choices"] = [{"finish_reason": "length", "completion_tokens": 3}, {"finish_reason": "stop", "completion_tokens": 2}]
    replay = Replay((SseEvent("token", "{}"), SseEvent("done", json.dumps(raw))), "r9")
    hit = json.loads([event async for event in replay.events][-1].data)
    assert hit["cached"] and hit["usage"]["completion_tokens"] == 0
    assert hit["choices"] == [{"finish_reason": "length", "completion_tokens": 0},
                              {"finish_reason": "stop", "completion_tokens": 0}]
