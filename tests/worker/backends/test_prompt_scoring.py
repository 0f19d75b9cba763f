"""A scored prompt (`prompt_logprobs`) on the real model, in the batch beside other requests: its scores are
the ones it gets alone, the stream beside it generates what it generates alone, a prompt the worker has
cached is still scored whole, and an engine that cannot score refuses with 400.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.sse import SseParser
from tests.sse import Stream, generate
from tests.worker.server import RunningWorker, running_worker

pytestmark = pytest.mark.model

# About 150 tokens: three chunks of SCORE_CHUNK.
PROMPT = "The tide came in over the sand, and the gulls rose from the harbour wall. " * 9
# llama.cpp's logits for one row move with the shape of the batch it is in (other rows beside it, another
# split of the prompt): by up to 0.14 here for a prompt scored beside one decoding stream.
ROUNDING = 0.3
# Long enough to be decoding through both scored prompts beside it (each three chunk steps and a token).
CHAT = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 160, "temperature": 0,
        "ignore_eos": True}


def scored(url: str, prompt: str = PROMPT, **more: Any) -> tuple[Stream, list[float | None], list[list[Any]]]:
    stream = generate(url, {"prompt": prompt, "raw": True, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
                            **more})
    events = [data for event, data in stream.events if event == "prompt"]
    assert stream.last[0] == "done" and events, stream.events[-1:]
    assert [e["start"] for e in events] == sorted({e["start"] for e in events})
    return stream, [v for e in events for v in e["logprobs"]], [t for e in events for t in e["top"]]


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    # Split KV with its prompt cache: a finished prompt's cells stay for the next request.
    with running_worker(model_path, max_sessions=4, session_max_tokens=512) as running:
        yield running


def test_a_prompt_scored_beside_a_decoding_stream_gets_its_scores_alone_and_changes_nothing_of_the_other(
        worker: RunningWorker) -> None:
    alone_chat = generate(worker.url, CHAT).text
    first, alone, alone_top = scored(worker.url)
    assert first.last[1]["usage"]["cached_tokens"] == 0
    n = first.last[1]["usage"]["prompt_tokens"]
    assert len(alone) == n > 128 and alone[0] is None and all(v is not None and v <= 0 for v in alone[1:])
    assert alone_top[0] == [] and all(len(t) == 2 and t[0][1] >= t[1][1] for t in alone_top[1:])

    beside: list[str] = []
    decoding = threading.Event()
    chat = threading.Thread(target=chat_into, args=(worker.url, beside, decoding))
    chat.start()
    assert decoding.wait(30), "the chat never started"  # its rows are in every step the scored prompts take
    again = [scored(worker.url, PROMPT.replace("tide", "tide", 1)) for _ in range(2)]  # while the chat decodes
    chat.join(timeout=60)
    assert not chat.is_alive() and "".join(beside) == alone_chat
    for stream, values, top in again:
        # Scored whole again though its cells were kept (a cached prompt has no logits), its rows read as
        # its own: the numbers it had alone, up to llama.cpp's rounding in a batch of another shape (a
        # row read for another position's would be off by nats, not hundredths).
        assert stream.last[1]["usage"]["cached_tokens"] == 0 and values[0] is None
        gaps = [abs(v - a) for v, a in zip(values[1:], alone[1:], strict=True)]  # type: ignore[operator]
        print("largest and mean gap beside a decoding stream:", max(gaps), sum(gaps) / len(gaps))
        assert max(gaps) <= ROUNDING and sum(gaps) / len(gaps) <= ROUNDING / 5, (max(gaps), sum(gaps) / len(gaps))
        same = sum(row[0][0] == was[0][0] for row, was in zip(top[1:], alone_top[1:], strict=True))
        assert same >= 0.9 * (len(top) - 1)


def chat_into(url: str, text: list[str], decoding: threading.Event) -> None:
    """CHAT streamed into `text`; `decoding` set at its first token."""
    parser = SseParser()
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/worker/generate", json=CHAT) as response:
        for chunk in response.iter_bytes():
            for event in parser.feed(chunk):
                if event.event == "token":
                    text.append(json.loads(event.data)["token"])
                    decoding.set()


def test_nothing_generated_when_max_tokens_is_0_and_0_needs_the_scores(worker: RunningWorker) -> None:
    stream, values, top = scored(worker.url, "Hello there, friend.", max_tokens=0, prompt_logprobs=0)
    assert stream.tokens == [] and stream.last[1]["usage"]["completion_tokens"] == 0
    assert len(values) == stream.last[1]["usage"]["prompt_tokens"] and all(row == [] for row in top)
    refused = generate(worker.url, {"prompt": "Hello", "raw": True, "max_tokens": 0})
    assert refused.status == 400 and "prompt_logprobs" in refused.body["error"]  # type: ignore[index]


def test_an_engine_that_cannot_score_refuses_with_400(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as simulated:
        refused = generate(simulated.url, {"prompt": "Hello", "raw": True, "max_tokens": 1, "prompt_logprobs": 1})
    assert refused.status == 400 and "does not score" in refused.body["error"]  # type: ignore[index]
