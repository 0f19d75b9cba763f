"""Several choices from one prompt on the real model: prefilled once, its cells copied to n sequences.

The copy must change nothing but the work (greedy choices all equal the one-choice answer, with a split
KV cache and with a unified one), each choice must sample on its own (seeded: repeatably), the KV
accounting must equal llama.cpp's own count of every choice's sequence, and whatever way the request
ends, every sequence and reservation comes back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.polling import wait_until
from tests.sse import Stream, generate
from tests.worker.server import RunningWorker, running_worker
from worker.backends.llama_engine import state_seq_size

pytestmark = pytest.mark.model

ASK = {"messages": [{"role": "user", "content": "Write one sentence about the sea."}], "max_tokens": 10}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=6, session_max_tokens=512) as running:
        yield running


def texts(stream: Stream, n: int) -> list[str]:
    assert stream.last[0] == "done", stream.last
    return ["".join(t["token"] for t in stream.tokens if t.get("choice", 0) == i) for i in range(n)]


@pytest.mark.parametrize("unified", [False, True])
def test_greedy_choices_all_equal_the_one_choice_answer(model_path: Path, unified: bool) -> None:
    with running_worker(model_path, max_sessions=4, session_max_tokens=256, kv_unified=unified) as worker:
        alone = generate(worker.url, {**ASK, "temperature": 0})
        several = generate(worker.url, {**ASK, "temperature": 0, "n": 3})
        assert texts(several, 3) == texts(alone, 1) * 3 and texts(alone, 1)[0]
        done = several.last[1]
        assert done["usage"]["prompt_tokens"] == alone.last[1]["usage"]["prompt_tokens"]  # the prompt once
        assert done["usage"]["completion_tokens"] == 3 * alone.last[1]["usage"]["completion_tokens"]
        assert [c["completion_tokens"] for c in done["choices"]] == [alone.last[1]["usage"]["completion_tokens"]] * 3
        wait_until(lambda: worker.load()["kv_reserved_bytes"] == 0 == worker.load()["sessions"], 5.0,
                   "every choice's sequence to be free")


def test_choices_sample_on_their_own_and_a_seed_repeats_each(worker: RunningWorker) -> None:
    sampled = texts(generate(worker.url, {**ASK, "temperature": 1.0, "n": 4}), 4)
    assert all(sampled) and len(set(sampled)) > 1
    seeded = {**ASK, "temperature": 1.0, "seed": 1234}
    first, again = (texts(generate(worker.url, {**seeded, "n": 2}), 2) for _ in range(2))
    assert first == again and first[0] != first[1]
    # Choice 0 draws from the seed itself: the one-choice answer of that seed.
    assert texts(generate(worker.url, seeded), 1)[0] == first[0]


def _hold(url: str, body: dict[str, Any], choices: int, seen: threading.Event,
          release: threading.Event) -> threading.Thread:
    """A stream kept open, once every choice has produced a token, until `release` is set."""
    def run() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/worker/generate", json=body) as r:
            started: set[int] = set()
            lines = r.iter_lines()
            while len(started) < choices:
                line = next(lines)
                if line.startswith("data: {\"token\""):
                    started.add(int(line.split('"choice":')[1].rstrip("}")) if '"choice"' in line else 0)
            seen.set()
            release.wait(timeout=30)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_choice_is_accounted_exactly_and_a_client_that_leaves_frees_them_all(worker: RunningWorker) -> None:
    seen, release = threading.Event(), threading.Event()
    body = {**ASK, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "n": 3}
    holder = _hold(worker.url, body, 3, seen, release)
    try:
        assert seen.wait(timeout=60)
        [job] = list(worker.runtime.jobs)
        bpt = worker.runtime.model.bytes_per_token

        def counts(ctx: Any) -> list[tuple[int, int]]:  # between two steps: the table and llama.cpp agree
            return [(len(s.tokens) * bpt, state_seq_size(s.seq_id)(ctx)) for s in job.sessions]

        # A choice's first token is sampled from the prompt's last step and enters the KV with the next
        # one: wait until every choice holds a generated token too.
        deadline = time.monotonic() + 10
        while True:
            pairs = worker.runtime.engine.call(counts).result(timeout=10)
            if all(ours > len(job.prompt_tokens) * bpt for ours, _ in pairs) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(pairs) == 3 and len({s.seq_id for s in job.sessions}) == 3
        for ours, theirs in pairs:
            assert ours > len(job.prompt_tokens) * bpt and abs(ours - theirs) / theirs < 0.05, (ours, theirs)
        load = worker.load()
        need = min(512, len(job.prompt_tokens) + 400)
        assert load["sessions"] == 3 and load["kv_reserved_bytes"] == 3 * need * bpt
    finally:
        release.set()
        holder.join(timeout=30)  # closes the stream: the worker cancels the request
    wait_until(lambda: worker.load()["kv_reserved_bytes"] == 0 == worker.load()["sessions"], 15.0,
               "the cancelled request's sequences to be free")
    assert worker.load()["active_streams"] == 0
