"""The prefix cache on a real worker with the real model, in both KV modes.

Two prompts that share a long system prompt: the second prefills only its own part, whether the first
is still generating, kept as a session, or gone (a split cache copies the prefix into the new sequence,
a unified one shares the cells). The worker's count of KV cells, shared cells once, equals what
llama.cpp holds. And sharing changes nothing in the output: a request's greedy text is the same with
the prefix prefilled, shared, or shared from a sequence freed meanwhile.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as ll
import pytest

from protocol.sse import SseParser
from protocol.worker import GenerateRequest
from tests.polling import wait_until
from tests.sse import Stream, generate
from tests.worker.server import RunningWorker, running_worker
from worker.engine import Engine, Failed, Finished, Job, StreamItem
from worker.model import Message, Model
from worker.textstream import Piece

pytestmark = pytest.mark.model

STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who told stories "
         "about the lighthouse, the storms, the ships that came and went, and the people who waited "
         "for them on the shore every evening when the sun went down behind the hills. ")
SYSTEM = "You are the village's storyteller. Here is what the village remembers. " + STORY * 4
OTHER_SYSTEM = "You are the lighthouse keeper. Answer in one sentence. " + STORY * 4
MODES = pytest.mark.parametrize("kv_unified", [False, True], ids=["split", "unified"])


def chat(question: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 12, "temperature": 0, **extra}


def shared_prefix(model: Model, *questions: str, system: str = SYSTEM) -> int:
    """Tokens the rendered prompts of these questions have in common: the system prompt and its template."""
    rendered = [model.tokenize(model.render_chat([Message("system", system), Message("user", q)]),
                               add_special=True) for q in questions]
    n = 0
    while all(len(r) > n and r[n] == rendered[0][n] for r in rendered):
        n += 1
    return n


def reused(stream: Stream) -> tuple[int, int]:
    usage = stream.last[1]["usage"]
    return usage["cached_tokens"], usage["prompt_tokens"]


def generate_then_delete(url: str, payload: dict[str, Any], session_id: str) -> Stream:
    """`generate`, deleting a session once the first token is out."""
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/worker/generate", json=payload) as response:
        assert response.status_code == 200
        parser, events, deleted = SseParser(), [], False
        for chunk in response.iter_bytes():
            events += parser.feed(chunk)
            if not deleted and any(e.event == "token" for e in events):
                assert httpx.delete(f"{url}/worker/sessions/{session_id}").status_code == 204
                deleted = True
        assert deleted
    return Stream(200, dict(response.headers), [(e.event, json.loads(e.data)) for e in events])


@pytest.fixture(scope="module", params=[False, True], ids=["split", "unified"])
def worker(request: pytest.FixtureRequest, model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, kv_unified=request.param, max_sessions=6, session_max_tokens=1024) as running:
        yield running


def test_a_second_prompt_prefills_only_its_own_part(worker: RunningWorker, model: Model) -> None:
    p = shared_prefix(model, "Who told the stories?", "Where was the village?")
    assert p > 150, p  # the premise: a long shared system prompt
    before = worker.metric('worker_prefix_reused_tokens_total{source="other"}')
    first = generate(worker.url, chat("Who told the stories?", session_id="first"))
    assert reused(first)[0] == 0
    second = generate(worker.url, chat("Where was the village?"))
    cached, prompt = reused(second)
    assert cached == p, (cached, p)  # the whole system prompt, from the kept session's cells
    assert prompt - cached < 16  # its own turn: the question and the template around it
    assert worker.metric('worker_prefix_reused_tokens_total{source="other"}') - before == p
    assert httpx.delete(worker.url + "/worker/sessions/first").status_code == 204


def test_a_running_request_shares_its_prefix_with_a_new_one(worker: RunningWorker, model: Model) -> None:
    p = shared_prefix(model, "Tell me everything you know.", "What came and went?", system=OTHER_SYSTEM)
    holding, release = threading.Event(), threading.Event()

    def long_running() -> None:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", worker.url + "/worker/generate",
                json=chat("Tell me everything you know.", OTHER_SYSTEM, max_tokens=400, ignore_eos=True)) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("event: token"):
                pass  # its prompt is prefilled once its first token is out
            holding.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=long_running, daemon=True)
    thread.start()
    try:
        assert holding.wait(timeout=60)
        cached, _ = reused(generate(worker.url, chat("What came and went?", OTHER_SYSTEM)))
        assert cached == p, (cached, p)  # no other sequence holds this system prompt
    finally:
        release.set()
        thread.join(timeout=30)
    wait_until(lambda: worker.load()["sessions"] == 0, 10.0, "the long request to be cancelled")


# -- accounting against llama.cpp ------------------------------------------------------------------------


def llama_cells(max_sessions: int, bytes_per_token: int) -> Callable[[Any], tuple[dict[int, int], int]]:
    """For `Engine.call`: the positions each sequence holds (pos_min..pos_max: llama.cpp keeps them whole),
    and the distinct cells of the whole cache, read from its saved-state size: a fixed header, then per
    cell its K and V rows (bytes_per_token), position and seq-id count (8 bytes), and 4 bytes per seq
    id on it. A sequence's own state has the same header and 4 bytes for its one id per cell."""
    def run(ctx: Any) -> tuple[dict[int, int], int]:
        mem = ll.llama_get_memory(ctx)
        held = {}
        for seq_id in range(max_sessions):
            lo, hi = ll.llama_memory_seq_pos_min(mem, seq_id), ll.llama_memory_seq_pos_max(mem, seq_id)
            if hi >= 0:
                assert lo == 0, (seq_id, lo)
                held[seq_id] = hi + 1
        headers = {int(ll.llama_state_seq_get_size(ctx, ctypes.c_int32(s))) - n * (bytes_per_token + 12)
                   for s, n in held.items()}
        assert len(headers) == 1, headers
        whole = int(ll.llama_state_seq_get_size(ctx, ctypes.c_int32(-1)))
        cells, rest = divmod(whole - headers.pop() - 4 * sum(held.values()), bytes_per_token + 8)
        assert rest == 0, rest
        return held, cells
    return run


def test_kv_cells_are_what_llama_cpp_holds_with_shared_cells_counted_once(model_path: Path, model: Model) -> None:
    questions = ("Who told the stories?", "Where was the village?", "What came and went?")
    with running_worker(model_path, kv_unified=True, max_sessions=6, session_max_tokens=1024) as worker:
        runtime = worker.runtime
        engine, table, bpt = runtime.engine, runtime.table, runtime.model.bytes_per_token
        assert isinstance(engine, Engine)
        for i, question in enumerate(questions):  # three kept sessions, the last two sharing the first's prefix
            generate(worker.url, chat(question, session_id=f"s{i}"))
        generate(worker.url, chat("When did the sun go down?"))  # a one-shot: its cells stay as cache
        held, cells = engine.call(llama_cells(6, bpt)).result(timeout=30)
        ours = table.cells()
        p = shared_prefix(model, *questions)
        assert ours.shared >= p and ours.cached > 0
        assert cells == ours.live + ours.cached < sum(held.values()), (held, cells, ours)
        sessions = [table.lookup(f"s{i}") for i in range(3)]
        assert {s.seq_id: len(s.tokens) for s in sessions if s}.items() <= held.items()
        assert worker.load()["kv_used_bytes"] == ours.live * bpt
        assert worker.load()["kv_reserved_bytes"] == ours.live * bpt  # all idle: nothing more promised
        assert worker.metric("worker_kv_shared_tokens") == ours.shared
        assert worker.metric("worker_prefix_cache_tokens") == ours.cached
        # llama.cpp frees a cell when no sequence is left on it, and so does the count: deleting the
        # session that wrote the system prompt frees its own turn's cells, not the shared ones
        first = sessions[0]
        assert first is not None
        assert httpx.delete(worker.url + "/worker/sessions/s0").status_code == 204
        _, left = engine.call(llama_cells(6, bpt)).result(timeout=30)  # after the free: the inbox is FIFO
        after = table.cells()
        assert left == after.live + after.cached and worker.load()["kv_used_bytes"] == after.live * bpt
        assert 0 < cells - left <= len(first.tokens) - p


def test_split_kv_cells_are_what_llama_cpp_holds_per_sequence(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=4, session_max_tokens=1024) as worker:
        runtime = worker.runtime
        engine, table = runtime.engine, runtime.table
        assert isinstance(engine, Engine)
        generate(worker.url, chat("Who told the stories?", session_id="a"))
        generate(worker.url, chat("Where was the village?", session_id="b"))  # a copy of a's prefix
        generate(worker.url, chat("What came and went?"))  # its cells stay as cache
        held = engine.call(lambda ctx: {
            s: ll.llama_memory_seq_pos_max(ll.llama_get_memory(ctx), s) + 1 for s in range(4)}).result(timeout=30)
        ours = table.cells()
        assert ours.shared == 0 and sum(held.values()) == ours.live + ours.cached
        for name in ("a", "b"):
            session = table.lookup(name)
            assert session is not None and held[session.seq_id] == len(session.tokens)
        assert worker.load()["kv_used_bytes"] == ours.live * runtime.model.bytes_per_token


# -- sharing changes nothing in the output ---------------------------------------------------------------


@MODES
def test_freeing_the_first_sequence_leaves_the_seconds_output_unchanged(model_path: Path, model: Model,
                                                                        kv_unified: bool) -> None:
    """B's greedy answer without a prefix cache, then taking A's system prompt (shared cells, or a
    copy llama.cpp makes at the next decode) with A's session deleted before B's first decode: the same
    text. The prefill chunk is the shared prefix, so both ways decode the same chunks of the same tokens
    (batch composition changes float results otherwise). The deletion lands between B taking the cells
    and B's first decode, which is also when a split cache's copy is still pending. (A deleted later,
    while B generates, frees cells B's next tokens then land in: with a unified cache that reorders
    attention sums, float rounding that can change a greedy pick; docs/benchmarks.md.)"""
    a, b = "Tell me everything you know.", "What did the people wait for?"
    p = shared_prefix(model, a, b)
    settings: dict[str, Any] = {"kv_unified": kv_unified, "max_sessions": 4, "session_max_tokens": 1024,
                                "prefill_chunk": p}
    with running_worker(model_path, prompt_cache=False, **settings) as plain:
        expected = generate(plain.url, chat(b, max_tokens=24))
    assert reused(expected)[0] == 0 and len(expected.tokens) > 5
    with running_worker(model_path, **settings) as worker:
        generate(worker.url, chat(a, session_id="a", max_tokens=40))
        runtime = worker.runtime
        assert isinstance(runtime.engine, Engine)
        paused, resume = threading.Event(), threading.Event()

        def hold(ctx: Any) -> None:  # the engine waits here, between two steps
            paused.set()
            resume.wait(timeout=30)

        runtime.engine.call(hold)
        assert paused.wait(timeout=30)
        request = GenerateRequest.model_validate(chat(b, max_tokens=24))
        job = asyncio.run_coroutine_threadsafe(runtime.gate.admit(request, "b"), worker.loop).result(timeout=30)

        def delete_a(ctx: Any) -> None:  # what DELETE /worker/sessions/a does, on the engine thread
            ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), runtime.table.delete("a").seq_id, -1, -1)

        deleted = runtime.engine.call(delete_a)  # runs after B's job begins, before the next decode
        resume.set()
        deleted.result(timeout=30)
        items = asyncio.run_coroutine_threadsafe(drain(job), worker.loop).result(timeout=60)
    done = items[-1]
    assert isinstance(done, Finished) and done.cached_tokens == p and job.copied_tokens == p
    assert "".join(i.text for i in items if isinstance(i, Piece)) == expected.text


async def drain(job: Job) -> list[StreamItem]:
    items = [await job.channel.get()]
    while not isinstance(items[-1], Finished | Failed):
        items.append(await job.channel.get())
    return items
