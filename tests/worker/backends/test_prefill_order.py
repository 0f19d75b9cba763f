"""Prefill order on the real model: the shortest remaining prompt goes first, so a short prompt
that joins while a long one is still being prefilled gets its first token before the long one does,
instead of waiting behind all of the long prompt's chunks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.sse import Stream, generate
from tests.worker.server import running_worker

# Not `solo`: it compares which stream ends first, which another process's load slows alike (3 of 3
# passed beside load averages of 8-10 on the 2-core machine, 2026-11-29).
pytestmark = pytest.mark.model

LONG = "Describe the harbour, the boats, the gulls and the weather in great detail. " * 30


def test_a_short_prompt_overtakes_a_long_prompt_still_in_prefill(model_path: Path) -> None:
    # 16 prompt tokens a step: the long prompt (~500 tokens) needs about 30 steps of prefill.
    with running_worker(model_path, max_sessions=4, session_max_tokens=1024, prefill_chunk=16,
                        threads=1, prompt_cache=False) as worker:
        finished: dict[str, float] = {}
        streams: dict[str, Stream] = {}

        def run(name: str, prompt: str) -> None:
            streams[name] = generate(worker.url, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
            finished[name] = time.monotonic()

        long = threading.Thread(target=run, args=("long", LONG))
        long.start()
        deadline = time.monotonic() + 30
        while worker.load()["active_streams"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a few of its chunks are in
        assert "long" not in finished, "the long prompt was prefilled before the short one came"
        run("short", "Hi")
        long.join(timeout=120)
        assert streams["long"].last[0] == "done" and streams["short"].last[0] == "done"
        long_prompt = streams["long"].last[1]["usage"]["prompt_tokens"]
        assert long_prompt > 300, long_prompt  # many steps of prefill left when the short one came
        # With one token each, a request's stream ends with its first token.
        assert finished["short"] < finished["long"]
