"""A new request copies the prompt prefix another sequence holds (split KV), on the real model.

The copy must change nothing but the work: the same greedy tokens as a worker that prefilled the
whole prompt, and KV accounting that still equals llama.cpp's own count of the copied sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.backends.llama_engine import state_seq_size

pytestmark = pytest.mark.model

SYSTEM = ("You are the keeper of an old lighthouse on a rocky island. You answer visitors plainly, "
          "you remember every storm and every ship, and you never hurry. ") * 4


def chat(question: str, max_tokens: int = 12) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512) as running:
        yield running


def _hold(url: str, body: dict[str, object], started: threading.Event, release: threading.Event) -> threading.Thread:
    """A stream that stays open (read up to its first token) until `release` is set."""
    def run() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/worker/generate", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("event: token"):
                pass
            started.set()
            release.wait(timeout=30)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_request_copies_the_prefix_a_running_sequence_holds(worker: RunningWorker, model_path: Path) -> None:
    started, release = threading.Event(), threading.Event()
    holder = _hold(worker.url, {**chat("Tell me a long story about the sea.", 400), "ignore_eos": True},
                   started, release)
    try:
        assert started.wait(timeout=30)
        copied_before = worker.metric("worker_copied_prompt_tokens_total")
        second = generate(worker.url, {**chat("What do you see tonight?"), "session_id": "copy-1"})
        assert second.last[0] == "done"
        usage = second.last[1]["usage"]
        copied = worker.metric("worker_copied_prompt_tokens_total") - copied_before
        # Everything but the question's own turn came from the running sequence's cells.
        assert copied == usage["cached_tokens"] >= 100 and usage["prompt_tokens"] - usage["cached_tokens"] < 30
        # Exact accounting: the table's count for the session equals llama.cpp's state of that sequence.
        session = worker.runtime.table.lookup("copy-1")
        assert session is not None
        ours = len(session.tokens) * worker.runtime.model.bytes_per_token
        theirs = worker.runtime.engine.call(state_seq_size(session.seq_id)).result(timeout=10)
        assert abs(ours - theirs) / theirs < 0.05, f"ours {ours} B vs llama.cpp {theirs} B"
    finally:
        release.set()
        holder.join(timeout=30)
        httpx.delete(worker.url + "/worker/sessions/copy-1")
    with running_worker(model_path, max_sessions=4, session_max_tokens=512, prompt_cache=False) as plain:
        alone = generate(plain.url, chat("What do you see tonight?"))
        assert alone.last[1]["usage"]["cached_tokens"] == 0
    assert second.text == alone.text and len(second.tokens) == len(alone.tokens) > 0


def test_a_short_shared_prefix_is_prefilled_not_copied(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=4, session_max_tokens=512, prefix_min_tokens=10_000) as worker:
        started, release = threading.Event(), threading.Event()
        holder = _hold(worker.url, {**chat("Tell me a long story.", 400), "ignore_eos": True}, started, release)
        try:
            assert started.wait(timeout=30)
            second = generate(worker.url, chat("And tonight?"))
            assert second.last[1]["usage"]["cached_tokens"] == 0
            assert worker.metric("worker_copied_prompt_tokens_total") == 0
        finally:
            release.set()
            holder.join(timeout=30)
