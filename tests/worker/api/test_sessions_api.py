"""Sessions, KV accounting and capacity on a real worker with the real model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from protocol.health import Heartbeat
from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.backends.llama_engine import state_seq_size
from worker.sessions.messages import Message

pytestmark = pytest.mark.model

STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who told stories "
         "about the lighthouse, the storms, the ships that came and went, and the people who waited "
         "for them on the shore every evening when the sun went down behind the hills. ") * 3


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, session_ttl=2.0, sweep_interval=0.2) as running:
        yield running


def template_opening(worker: RunningWorker) -> int:
    """Tokens every chat prompt of this model starts with (its template's opening and default system
    prompt): what a freed sequence can share with any new conversation."""
    model = worker.runtime.gate.model
    a, b = (model.tokenize(model.render_chat([Message("user", text)]), add_special=True) for text in ("x", "y"))
    return next(i for i, (s, t) in enumerate(zip(a, b, strict=False)) if s != t)


def test_kv_accounting_matches_llama_cpp_state_size(worker: RunningWorker) -> None:
    stream = generate(worker.url, {"prompt": STORY, "session_id": "kv-check", "max_tokens": 20,
                                   "temperature": 0})
    assert stream.last[0] == "done"
    session = worker.runtime.table.lookup("kv-check")
    assert session is not None
    ours = len(session.tokens) * worker.runtime.model.bytes_per_token
    theirs = worker.runtime.engine.call(state_seq_size(session.seq_id)).result(timeout=10)
    assert len(session.tokens) > 100
    assert abs(ours - theirs) / theirs < 0.05, f"ours {ours} B vs llama.cpp {theirs} B"
    listed = {s["session_id"]: s for s in httpx.get(worker.url + "/worker/sessions").json()["sessions"]}
    assert listed["kv-check"]["kv_bytes"] == ours and listed["kv-check"]["busy"] is False
    assert httpx.delete(worker.url + "/worker/sessions/kv-check").status_code == 204


def test_session_reuse_prefills_only_the_new_turn(worker: RunningWorker) -> None:
    first = generate(worker.url, {"prompt": STORY + "Who is the story about?", "session_id": "chat-1",
                                  "max_tokens": 16, "temperature": 0})
    second = generate(worker.url, {"prompt": "And where does he live?", "session_id": "chat-1",
                                   "max_tokens": 16, "temperature": 0})
    u1, u2 = first.last[1]["usage"], second.last[1]["usage"]
    assert u1["cached_tokens"] == 0
    new_turn = len(worker.runtime.model.tokenize("And where does he live?", add_special=False))
    prefilled = u2["prompt_tokens"] - u2["cached_tokens"]
    # Prefilled: the new message, its template tokens, and at most the reply's last tokens re-read.
    assert u2["prompt_tokens"] > u1["prompt_tokens"] + new_turn
    assert prefilled <= new_turn + 12, (u1, u2)
    # The same conversation without a session prefills everything but the template's opening (its
    # default system prompt), which a freed sequence may still hold.
    fresh = generate(worker.url, {"prompt": "And where does he live?", "session_id": "chat-fresh",
                                  "max_tokens": 1, "temperature": 0})
    assert fresh.last[1]["usage"]["cached_tokens"] <= template_opening(worker)
    print(f"\nsession reuse: turn 1 prefilled {u1['prompt_tokens']} tokens, ttft "
          f"{first.last[1]['timings']['ttft_ms']:.1f} ms; turn 2 prefilled {prefilled} of "
          f"{u2['prompt_tokens']}, ttft {second.last[1]['timings']['ttft_ms']:.1f} ms")
    for name in ("chat-1", "chat-fresh"):
        httpx.delete(f"{worker.url}/worker/sessions/{name}")


def test_idle_session_expires_after_ttl_and_frees_kv(worker: RunningWorker) -> None:
    generate(worker.url, {"prompt": "Hello", "session_id": "short-lived", "max_tokens": 4})
    assert worker.load()["kv_used_bytes"] > 0
    wait_until(lambda: worker.load()["sessions"] == 0, 6.0, "the idle session to expire")
    assert worker.load()["kv_used_bytes"] == 0 and worker.load()["kv_reserved_bytes"] == 0
    # The coordinator claims a continuation: the conversation is gone, and it must not restart silently.
    late = generate(worker.url, {"prompt": "Still there?", "session_id": "short-lived", "max_tokens": 4},
                    headers={"x-session-expected": "1"})
    assert late.status == 404 and late.body is not None and late.body["reason"] == "session_expired"
    assert worker.metric("worker_sessions_expired_total") >= 1
    # No claim (the coordinator forgot the id too): the id starts a new conversation, as any new id would.
    # Before, its tombstone answered 404 session_expired to every request with that id, indefinitely.
    fresh = generate(worker.url, {"prompt": "Hello again", "session_id": "short-lived", "max_tokens": 4})
    assert fresh.status == 200 and fresh.last[1]["usage"]["cached_tokens"] <= template_opening(worker)
    assert worker.load()["sessions"] == 1
    assert httpx.delete(worker.url + "/worker/sessions/short-lived").status_code == 204


def test_a_session_the_caller_expects_but_the_worker_lacks_is_404_not_a_fresh_start(worker: RunningWorker) -> None:
    expected = generate(worker.url, {"prompt": "Continue.", "session_id": "lost-1", "max_tokens": 4},
                        headers={"X-Session-Expected": "1"})
    assert expected.status == 404 and expected.body is not None and expected.body["reason"] == "unknown_session"
    assert worker.load()["sessions"] == 0
    first_turn = generate(worker.url, {"prompt": "Start.", "session_id": "lost-1", "max_tokens": 4})
    assert first_turn.status == 200  # without the header an unknown id starts a conversation
    again = generate(worker.url, {"prompt": "Go on.", "session_id": "lost-1", "max_tokens": 4},
                     headers={"X-Session-Expected": "1"})
    assert again.status == 200 and again.last[1]["usage"]["cached_tokens"] > 0
    httpx.delete(worker.url + "/worker/sessions/lost-1")


def test_deleting_an_unknown_session_is_404(worker: RunningWorker) -> None:
    response = httpx.delete(worker.url + "/worker/sessions/nobody")
    assert response.status_code == 404 and response.json()["reason"] == "unknown_session"


def test_heartbeats_list_the_stream_references_of_running_streams(worker: RunningWorker) -> None:
    """The coordinator's `X-Stream-Ref` is listed in the load while its stream holds a session, and no
    longer once it ended: what lets the coordinator tell which of its streams a heartbeat counts."""
    started, release = threading.Barrier(3), threading.Event()
    threads = _hold_streams(worker.url, 2, started, release, refs=[41, 2**63 - 1])
    started.wait(timeout=20)
    load = worker.load()
    assert sorted(load["streams"]) == [41, 2**63 - 1] and load["sessions"] >= 2
    release.set()
    for thread in threads:
        thread.join(timeout=20)
    wait_until(lambda: worker.load()["streams"] == [], 5.0, "the references to go with their streams")
    for bad in ("-1", "x", str(2**63), "1" * 20):
        refused = generate(worker.url, {"prompt": "Hi", "max_tokens": 2}, headers={"x-stream-ref": bad})
        assert refused.status == 400 and refused.body is not None and "x-stream-ref" in refused.body["error"]


def _hold_streams(url: str, n: int, started: threading.Barrier, release: threading.Event,
                  refs: list[int] | None = None) -> list[threading.Thread]:
    """Starts n long streams that stay open (reading slowly) until `release` is set."""
    def run(headers: dict[str, str]) -> None:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", url + "/worker/generate", headers=headers,
                json={"prompt": "Tell a long story.", "max_tokens": 300, "ignore_eos": True}) as response:
            lines = response.iter_lines()
            next(lines)
            started.wait(timeout=20)
            release.wait(timeout=20)
    headers = [{"x-stream-ref": str(ref)} for ref in refs] if refs else [{} for _ in range(n)]
    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in headers]
    for thread in threads:
        thread.start()
    return threads


def test_a_full_worker_refuses_with_its_reason_and_starts_nothing(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=2) as worker:
        started, release = threading.Barrier(3), threading.Event()
        threads = _hold_streams(worker.url, 2, started, release)
        started.wait(timeout=20)
        before = worker.load()
        refused = generate(worker.url, {"prompt": "One more?", "max_tokens": 8})
        assert refused.refusal is not None and refused.refusal["reason"] == "sessions_full"
        after = worker.load()
        assert after["sessions"] == before["sessions"] == 2
        assert after["kv_reserved_bytes"] == before["kv_reserved_bytes"]
        release.set()
        for thread in threads:
            thread.join(timeout=20)
        wait_until(lambda: worker.load()["sessions"] == 0, 5.0, "the held streams to end")
        assert generate(worker.url, {"prompt": "Now?", "max_tokens": 4}).status == 200


def test_kv_full_in_a_shared_cache(model_path: Path) -> None:
    # One unified KV pool of 1024 cells: two requests promising 600 cells each cannot both fit.
    with running_worker(model_path, kv_unified=True, ctx_size=1024, session_max_tokens=1024) as worker:
        started, release = threading.Barrier(2), threading.Event()

        def hold() -> None:
            with httpx.Client(timeout=30) as client, client.stream(
                    "POST", worker.url + "/worker/generate",
                    json={"prompt": "Tell a long story.", "max_tokens": 580, "ignore_eos": True}) as r:
                lines = r.iter_lines()  # keep it: a dropped iterator closes the response
                next(lines)
                started.wait(timeout=20)
                release.wait(timeout=20)

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        started.wait(timeout=20)
        refused = generate(worker.url, {"prompt": "Me too.", "max_tokens": 580})
        assert refused.refusal is not None and refused.refusal["reason"] == "kv_full"
        small = generate(worker.url, {"prompt": "Just a little.", "max_tokens": 8})
        assert small.status == 200 and small.last[0] == "done"
        release.set()
        thread.join(timeout=20)


def test_session_reaching_its_kv_limit_ends_with_length(model_path: Path) -> None:
    with running_worker(model_path, session_max_tokens=64) as worker:
        stream = generate(worker.url, {"prompt": "Tell a long story.", "max_tokens": 500, "ignore_eos": True,
                                       "session_id": "tiny"})
        _, done = stream.last
        assert done["finish_reason"] == "length"
        # the last sampled token is never decoded, so the KV holds prompt + completion - 1 = the limit
        assert done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"] - 1 == 64
        again = generate(worker.url, {"prompt": "More.", "session_id": "tiny", "max_tokens": 8})
        assert again.refusal is not None and again.refusal["reason"] == "prompt_too_long"


def test_slow_consumer_is_cancelled_and_frees_kv(model_path: Path) -> None:
    with running_worker(model_path, stream_buffer=4, slow_consumer_deadline=0.5) as worker:
        runtime = worker.runtime

        async def never_read() -> tuple[object, dict]:
            from protocol.worker import GenerateRequest
            job = await runtime.gate.admit(GenerateRequest(prompt="Talk.", max_tokens=200, ignore_eos=True), "slow-1")
            await asyncio.sleep(2.0)  # the engine keeps the batch going; this job pauses, then is dropped
            items = []
            while len(job.channel):
                items.append(await job.channel.get())
            return items[-1], runtime.load().model_dump()  # on the server's loop: no HTTP to itself

        future = asyncio.run_coroutine_threadsafe(never_read(), worker.loop)
        last, load = future.result(timeout=20)
        assert type(last).__name__ == "Failed" and last.reason == "slow_consumer"  # type: ignore[attr-defined]
        assert load["kv_used_bytes"] == 0 and load["sessions"] == 0


def test_heartbeats_reach_the_coordinator_with_load_and_token(model_path: Path) -> None:
    received: list[tuple[str, Heartbeat]] = []

    def coordinator(request: httpx.Request) -> httpx.Response:
        received.append((request.headers.get("authorization", ""), Heartbeat(**json.loads(request.content))))
        return httpx.Response(200, json={"ok": True})

    with running_worker(model_path, transport=httpx.MockTransport(coordinator),
                        coordinator_url="http://coordinator.test", worker_token="s3cret",
                        heartbeat_interval=0.2) as worker:
        wait_until(lambda: len(received) >= 2, 5.0, "two heartbeats")
    auth, beat = received[-1]
    assert auth == "Bearer s3cret"
    assert beat.worker_id == worker.settings.worker_id and beat.url == worker.url
    assert beat.load.bytes_per_token == 23040 and beat.load.max_sessions == 8
    assert abs(beat.timestamp - time.time()) < 5


def test_unreachable_coordinator_is_not_fatal(model_path: Path) -> None:
    with running_worker(model_path, coordinator_url="http://127.0.0.1:9", heartbeat_interval=0.1) as worker:
        time.sleep(0.5)
        assert generate(worker.url, {"prompt": "Still fine?", "max_tokens": 4}).last[0] == "done"


def test_request_past_its_deadline_ends_with_an_error_event_and_frees_kv(model_path: Path) -> None:
    with running_worker(model_path, request_timeout=0.5) as worker:
        stream = generate(worker.url, {"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True,
                                       "session_id": "late"})
        event, data = stream.last
        assert event == "error" and data["reason"] == "deadline_exceeded"
        assert 0 < len(stream.tokens) < 2000
        assert worker.load()["kv_used_bytes"] == 0 and worker.load()["sessions"] == 0
