"""The worker's generate API over real HTTP with the real SmolLM2 model."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.sessions.messages import Message

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path) as running:
        yield running




def test_stream_order_and_fields(worker: RunningWorker) -> None:
    stream = generate(worker.url, {"prompt": "Name three colors.", "max_tokens": 24, "temperature": 0},
                      headers={"X-Request-ID": "req-order-1"})
    assert stream.status == 200
    assert stream.headers["x-request-id"] == "req-order-1"
    assert stream.headers["x-worker-id"] == worker.settings.worker_id
    tokens = stream.tokens
    assert tokens, "no token events"
    assert [event for event, _ in stream.events[:-1]] == ["admitted"] + ["token"] * len(tokens)
    indexes = [t["index"] for t in tokens]
    assert indexes == sorted(set(indexes)) and indexes[0] == 0
    for t in tokens:
        assert set(t) == {"token", "index", "probability", "finished"}
        assert t["finished"] is False and 0.0 < t["probability"] <= 1.0 and t["token"]
    event, done = stream.last
    assert event == "done" and done["finished"] is True
    assert done["finish_reason"] in {"stop", "length"}
    assert done["request_id"] == "req-order-1" and done["worker_id"] == worker.settings.worker_id
    assert done["usage"]["prompt_tokens"] == stream.events[0][1]["prompt_tokens"]
    assert done["usage"]["completion_tokens"] >= indexes[-1] + 1
    assert done["usage"]["completion_tokens"] <= 24
    assert done["timings"]["ttft_ms"] <= done["timings"]["total_ms"]


def test_max_tokens_ends_with_length_and_counts_exactly(worker: RunningWorker) -> None:
    stream = generate(worker.url, {"prompt": "Count upwards: 1, 2, 3,", "raw": True, "max_tokens": 17,
                                   "ignore_eos": True, "temperature": 0})
    _, done = stream.last
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 17
    assert stream.tokens[-1]["index"] <= 16


def test_same_seed_same_text_greedy_is_deterministic(worker: RunningWorker) -> None:
    sampled = {"prompt": "Write a word.", "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    assert generate(worker.url, sampled).text == generate(worker.url, sampled).text
    greedy = {"prompt": "Write a word.", "max_tokens": 12, "temperature": 0}
    assert generate(worker.url, greedy).text == generate(worker.url, greedy).text


def test_without_probabilities_the_tokens_are_the_same_and_carry_none(worker: RunningWorker) -> None:
    body = {"prompt": "Name three animals.", "max_tokens": 12, "temperature": 0}
    with_p = generate(worker.url, body)
    without = generate(worker.url, {**body, "probabilities": False})
    assert without.last[0] == "done" and without.text == with_p.text
    assert [t["index"] for t in without.tokens] == [t["index"] for t in with_p.tokens]
    assert all(t["probability"] is None for t in without.tokens)
    assert all(0.0 < t["probability"] <= 1.0 for t in with_p.tokens)


def test_stop_string_cuts_the_output(worker: RunningWorker) -> None:
    free = generate(worker.url, {"prompt": "Count upwards: 1, 2, 3,", "raw": True, "max_tokens": 12,
                                 "temperature": 0})
    assert " 5," in free.text, free.text  # the premise: the model counts on
    stopped = generate(worker.url, {"prompt": "Count upwards: 1, 2, 3,", "raw": True, "max_tokens": 12,
                                    "temperature": 0, "stop": [" 5,"]})
    assert stopped.last[1]["finish_reason"] == "stop"
    assert stopped.text == free.text[: free.text.index(" 5,")]


def test_eight_concurrent_requests_complete_in_shared_batches(worker: RunningWorker) -> None:
    steps_before = worker.metric("worker_batch_size_count")
    seqs_before = worker.metric("worker_batch_size_sum")
    payloads = [{"prompt": f"Say something about the number {i}.", "max_tokens": 32, "ignore_eos": True,
                 "temperature": 0.7, "seed": i} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(lambda p: generate(worker.url, p), payloads))
    for stream in streams:
        assert stream.last[0] == "done" and stream.last[1]["usage"]["completion_tokens"] == 32
    steps = worker.metric("worker_batch_size_count") - steps_before
    sequences = worker.metric("worker_batch_size_sum") - seqs_before
    # 8 x 32 tokens decoded one sequence per step would take >= 256 steps; batching needs far fewer.
    assert sequences / steps > 4, f"{sequences} sequence-steps in {steps} decode calls"
    assert steps < 256 / 2


def test_cancel_frees_kv_within_a_step(worker: RunningWorker) -> None:
    cancelled_before = _finished(worker, "cancelled")
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", worker.url + "/worker/generate",
            json={"prompt": "Tell a very long story.", "max_tokens": 400, "ignore_eos": True}) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("event: token")
            if seen == 3:
                assert worker.load()["kv_used_bytes"] > 0
                break  # leaving the iterator closes the response: the client is gone
    wait_until(lambda: worker.load()["kv_used_bytes"] == 0 and worker.load()["sessions"] == 0, 3.0,
               "the cancelled request's KV to be freed")
    assert worker.load()["kv_reserved_bytes"] == 0
    assert _finished(worker, "cancelled") == cancelled_before + 1


def _finished(worker: RunningWorker, reason: str) -> float:
    try:
        return worker.metric(f'worker_requests_finished_total{{finish_reason="{reason}"}}')
    except KeyError:
        return 0.0


def test_utf8_output_is_intact(worker: RunningWorker) -> None:
    # Greedy SmolLM2 answers this with emoji, each of which spans several tokens.
    stream = generate(worker.url, {"prompt": "Emoji party: 🎉🎉🎉 日本語 ", "raw": True, "max_tokens": 30,
                                   "temperature": 0})
    text = stream.text
    assert any(ord(ch) > 0xFFFF for ch in text), f"premise: expected emoji in {text!r}"
    assert "\ufffd" not in text
    indexes = [t["index"] for t in stream.tokens]
    assert any(b - a > 1 for a, b in itertools.pairwise(indexes)), "some event must join several tokens"


@pytest.mark.parametrize(
    ("payload", "status", "reason", "field"),
    [
        ({}, 400, "invalid_request", "prompt"),
        ({"prompt": ""}, 400, "invalid_request", "prompt"),
        ({"prompt": "hi", "temperature": -1}, 400, "invalid_request", "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "invalid_request", "max_tokens"),
        ({"prompt": "hi", "surprise": 1}, 400, "invalid_request", "surprise"),
        ({"prompt": "hi", "session_id": "bad id!"}, 400, "invalid_request", "session_id"),
        ({"prompt": "hi", "grammar_lazy": True}, 400, "invalid_request", "grammar_lazy"),
        ({"prompt": "hi", "model": "gpt-17"}, 404, "unknown_model", "gpt-17"),
    ],
)
def test_bad_input_is_refused_before_any_work(worker: RunningWorker, payload: dict, status: int,
                                              reason: str, field: str) -> None:
    steps = worker.health()["batch_steps"]
    stream = generate(worker.url, payload, headers={"X-Request-ID": "bad-1"})
    assert stream.status == status
    assert stream.body is not None and stream.body["reason"] == reason and stream.body["request_id"] == "bad-1"
    assert field in stream.body["error"]
    assert worker.health()["batch_steps"] == steps


def test_a_prompt_too_long_is_refused_after_the_head_before_any_work(worker: RunningWorker) -> None:
    """Its length is known only once tokenized, which the worker does after answering its head (so
    that its silence never means a long prompt): the refusal is the stream's one event."""
    steps, before = worker.health()["batch_steps"], worker.load()
    stream = generate(worker.url, {"prompt": "word " * 600, "raw": True}, headers={"X-Request-ID": "long-1"})
    assert stream.refusal is not None and stream.refusal["reason"] == "prompt_too_long"
    assert stream.refusal["request_id"] == "long-1" and "512" in stream.refusal["error"]
    assert worker.health()["batch_steps"] == steps
    assert worker.load()["kv_reserved_bytes"] == before["kv_reserved_bytes"]


def test_malformed_json_is_400(worker: RunningWorker) -> None:
    response = httpx.post(worker.url + "/worker/generate", content=b"{not json",
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["reason"] == "invalid_request"


def test_a_repeated_one_shot_prompt_reuses_the_cells_it_left(worker: RunningWorker) -> None:
    payload = {"prompt": "Describe the moon in one sentence, please, for a child.", "max_tokens": 8,
               "temperature": 0}
    first = generate(worker.url, payload).last[1]
    second = generate(worker.url, payload).last[1]
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert second["usage"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1  # one token re-read for logits
    assert worker.load()["kv_used_bytes"] == 0 and worker.load()["sessions"] == 0
    other = generate(worker.url, {"prompt": "Name a fruit.", "max_tokens": 4, "temperature": 0}).last[1]
    # Another prompt reuses only what the two share: the template's opening and default system prompt.
    model = worker.runtime.gate.model
    first_tokens, other_tokens = (model.tokenize(model.render_chat([Message("user", text)]), add_special=True)
                                  for text in (payload["prompt"], "Name a fruit."))
    shared = next(i for i, (a, b) in enumerate(zip(first_tokens, other_tokens, strict=False)) if a != b)
    assert other["usage"]["cached_tokens"] == shared < other["usage"]["prompt_tokens"]


def test_without_the_prompt_cache_a_repeated_prompt_is_prefilled_again(model_path: Path) -> None:
    with running_worker(model_path, prompt_cache=False) as worker:
        payload = {"prompt": "Describe the sun in one sentence.", "max_tokens": 4, "temperature": 0}
        generate(worker.url, payload)
        assert generate(worker.url, payload).last[1]["usage"]["cached_tokens"] == 0


def test_chat_messages_are_rendered_with_the_models_template(worker: RunningWorker) -> None:
    user = {"role": "user", "content": "Name a fruit."}
    plain = generate(worker.url, {"messages": [user], "max_tokens": 4, "temperature": 0}).last[1]
    system = {"role": "system", "content": "You answer in French, in one word, always."}
    with_system = generate(worker.url, {"messages": [system, user], "max_tokens": 4, "temperature": 0}).last[1]
    prompt_only = generate(worker.url, {"prompt": "Name a fruit.", "max_tokens": 4, "temperature": 0}).last[1]
    # A prompt is one user turn: the same tokens as that one message.
    assert prompt_only["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # The system message replaces the template's default one rather than being pasted in as text.
    assert with_system["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"]
    both = generate(worker.url, {"prompt": "x", "messages": [user]})
    assert both.status == 400 and both.body is not None and "exactly one" in both.body["error"]


def test_a_resent_conversation_prefills_only_its_new_turn(worker: RunningWorker) -> None:
    history = [{"role": "user", "content": "Tell me about the moon, briefly."}]
    previous_prompt = 0
    for turn in range(3):
        stream = generate(worker.url, {"messages": history, "max_tokens": 12, "temperature": 0})
        done = stream.last[1]
        if turn:  # the cells the last turn left hold its whole prompt at least
            assert done["usage"]["cached_tokens"] >= previous_prompt, (turn, done["usage"], previous_prompt)
        previous_prompt = done["usage"]["prompt_tokens"]
        history += [{"role": "assistant", "content": stream.text}, {"role": "user", "content": f"And {turn}?"}]


class _HeldTokenizer:
    """The worker's model, with `tokenize` held until the test lets it go."""

    def __init__(self, model: object) -> None:
        self._model = model
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        self.entered.set()
        self.release.wait(timeout=30)
        return self._model.tokenize(text, add_special=add_special)  # type: ignore[attr-defined]


def test_the_head_and_pings_come_before_the_prompt_is_tokenized(worker: RunningWorker) -> None:
    """Version 3: a long prompt's tokenizing happens after the response head, with pings, so the
    coordinator's read timeout sees a live worker (before: no byte until admission, and four 3 MB
    bodies took both workers past it and opened their breakers)."""
    gate = worker.runtime.gate
    held = _HeldTokenizer(gate.model)
    gate.model = held  # type: ignore[assignment]
    try:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", worker.url + "/worker/generate", json={"prompt": "Hold on.", "max_tokens": 3}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith(":")) == ": ping"
            assert held.entered.is_set() and not held.release.is_set()  # pinged while tokenizing
            held.release.set()
            events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert events[0] == "admitted" and events[-1] == "done"
    finally:
        held.release.set()
        gate.model = held._model  # type: ignore[assignment]
