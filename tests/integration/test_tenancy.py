"""Tenancy end to end: a real coordinator with two client keys in front of a real worker whose prompt
cache and prefix copies are on (a split KV cache, the default). What one key left in the pool
(a session, a cached answer, a prompt's cells) tells another key nothing.

Before: key B continued key A's session (`cached_tokens` 29 of 47), and B's `cached_tokens` for A's
exact private prompt (66 of 67) told B its guess was right, where a wrong guess showed 15 of 67."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import TOKEN, Proc, start_coordinator, start_worker
from tests.polling import wait_until

pytestmark = pytest.mark.model
KEYS = {"A": "tenancy-key-a", "B": "tenancy-key-b", "C": "tenancy-key-c"}


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("tenancy-logs")
    coordinator, url = start_coordinator(logs, "tenancy-coordinator", "--worker-token", TOKEN, "--heartbeat-interval",
                                         "1", "--api-keys", ",".join(KEYS.values()), "--cache-entries", "100")
    worker, _ = start_worker(logs, "t1", url, model_path, "--threads", "1", "--heartbeat-interval", "0.5",
                             "--worker-token", TOKEN, "--max-sessions", "6", "--session-max-tokens", "512")
    try:
        wait_until(lambda: httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 1, 60,
                   "the worker to be alive")
        yield url
    finally:
        for proc in (worker, coordinator):
            Proc.stop(proc)


def ask(url: str, who: str, body: dict[str, Any]) -> dict[str, Any]:
    """The `done` event of one generation by `who`'s key."""
    response = httpx.post(url + "/coordinator/infer", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEYS[who]}"})
    assert response.status_code == 200, response.text
    last = [b for b in response.text.replace("\r\n", "\n").split("\n\n") if b.startswith("event: ")][-1]
    event, data = last.split("\n")[:2]
    assert event == "event: done", last
    return json.loads(data[6:])  # type: ignore[no-any-return]


def test_another_keys_session_is_neither_continued_nor_ended(pool: str) -> None:
    first = ask(pool, "A", {"prompt": "My secret number is 4242. Remember it.", "max_tokens": 4,
                            "temperature": 0, "session_id": "s1"})
    assert first["session_id"] == "s1"
    ended = httpx.delete(pool + "/coordinator/sessions/s1", headers={"x-api-key": KEYS["B"]}, timeout=10)
    assert (ended.status_code, ended.json()["reason"]) == (404, "unknown_session")
    theirs = ask(pool, "B", {"prompt": "What is my secret number?", "max_tokens": 4, "temperature": 0,
                             "session_id": "s1"})
    assert theirs["usage"]["cached_tokens"] == 0  # a conversation of its own, not appended to A's
    mine = ask(pool, "A", {"prompt": "What is my secret number?", "max_tokens": 4, "temperature": 0,
                           "session_id": "s1"})
    assert mine["usage"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1  # A's own goes on
    for who in ("A", "B"):
        assert httpx.delete(pool + "/coordinator/sessions/s1", headers={"x-api-key": KEYS[who]},
                            timeout=10).status_code == 204


def test_a_right_guess_of_another_keys_prompt_looks_like_a_wrong_one(pool: str) -> None:
    secret = "Account 7 has the PIN 3141 and the recovery word heliotrope. Summarise the account."
    wrong = "Account 7 has the PIN 2718 and the recovery word marigold. Summarise the account."
    sampled = {"max_tokens": 4, "temperature": 0.7}  # not cacheable as an answer: every one reaches the worker
    ask(pool, "A", {"prompt": secret, **sampled})
    right_guess = ask(pool, "B", {"prompt": secret, **sampled})
    wrong_guess = ask(pool, "C", {"prompt": wrong, **sampled})
    assert right_guess["usage"]["cached_tokens"] == wrong_guess["usage"]["cached_tokens"]
    assert right_guess["worker_id"] == "t1" and not right_guess["cached"]
    again = ask(pool, "A", {"prompt": secret, **sampled})  # the cache still works for its owner
    assert again["usage"]["cached_tokens"] > right_guess["usage"]["cached_tokens"]


def test_a_cached_answer_is_served_only_to_its_key(pool: str) -> None:
    greedy = {"prompt": "Name three rivers of France.", "max_tokens": 6, "temperature": 0}
    assert ask(pool, "A", greedy)["cached"] is False
    assert ask(pool, "B", greedy)["cached"] is False
    assert ask(pool, "A", greedy)["cached"] is True


def test_status_and_metrics_need_a_key(pool: str) -> None:
    for path in ("/metrics", "/coordinator/status"):
        assert httpx.get(pool + path, timeout=10).status_code == 401
        assert httpx.get(pool + path, headers={"x-api-key": KEYS["C"]}, timeout=10).status_code == 200
    assert httpx.get(pool + "/coordinator/health", timeout=10).status_code == 200
