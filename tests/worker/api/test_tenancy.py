"""Tenants on one worker: a session id, the prompt cache and prefix copies serve only the tenant that
made them (worker/sessions/table.py, Tenancy), over HTTP as the coordinator calls it.

Before, all three were shared: tenant B could continue A's session by sending its id, and B's
`usage.cached_tokens` told whether B's guess of A's private prompt was right.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.polling import wait_until
from tests.sse import Stream, generate
from tests.worker.server import running_worker
from worker.backends.llama_engine import Engine, state_seq_size


def test_session_ids_listing_and_delete_are_per_tenant(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as worker:
        def turn(tenant: str, prompt: str, *, expected: bool = False) -> Stream:
            return generate(worker.url, {"prompt": prompt, "max_tokens": 3, "session_id": "s", "tenant": tenant},
                            headers={"x-session-expected": "1"} if expected else {})

        first = turn("A", "hello there, this is A")
        assert first.status == 200 and first.last[1]["session_id"] == "s"  # the plain id, no tenant in it
        # B claims A's conversation: the same 404 as for an id B never used.
        claimed = turn("B", "continue", expected=True)
        assert claimed.status == 404 and claimed.body is not None and claimed.body["reason"] == "unknown_session"
        fresh = turn("B", "hello there, this is B")
        assert fresh.status == 200 and fresh.last[1]["usage"]["cached_tokens"] == 0
        listed = httpx.get(worker.url + "/worker/sessions", timeout=5).json()["sessions"]
        assert sorted((s["tenant"], s["session_id"]) for s in listed) == [("A", "s"), ("B", "s")]
        for query, status, reason in [("", 404, "unknown_session"), ("?tenant=C", 404, "unknown_session"),
                                      ("?tenant=no%20spaces", 400, "invalid_request"),
                                      ("?tenant=" + "x" * 65, 400, "invalid_request")]:
            refused = httpx.delete(worker.url + "/worker/sessions/s" + query, timeout=5)
            assert (refused.status_code, refused.json()["reason"]) == (status, reason), query
        assert httpx.delete(worker.url + "/worker/sessions/s?tenant=B", timeout=5).status_code == 204
        listed = httpx.get(worker.url + "/worker/sessions", timeout=5).json()["sessions"]
        assert [(s["tenant"], s["session_id"]) for s in listed] == [("A", "s")]
        again = turn("A", "and more from A", expected=True)  # A's conversation survived B's delete
        assert again.status == 200 and again.last[1]["usage"]["cached_tokens"] > 0
        bad = generate(worker.url, {"prompt": "hi", "tenant": "a b"})
        assert bad.status == 400 and bad.body is not None and bad.body["reason"] == "invalid_request"


SECRET = ("You keep the records of the harbour office. The password of the night vault is {}. "
          "Never tell it.")


def chat(password: str, tenant: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SECRET.format(password)},
                         {"role": "user", "content": "What is the weather like today?"}],
            "max_tokens": 8, "temperature": 0, "tenant": tenant, **extra}


@pytest.mark.model
def test_another_tenants_exact_prompt_is_no_more_cached_than_a_wrong_guess(model_path: Path) -> None:
    """B's guess of A's prompt, right or wrong, shows the same `cached_tokens`; A's own repeat is a hit.
    Without the tenant checks the right guess would show all but one token cached (A's leftover cells),
    and the wrong one the ~20 tokens it shares with A's prompt (a prefix copy)."""
    with running_worker(model_path, max_sessions=3, session_max_tokens=512) as worker:
        def usage(body: dict[str, Any]) -> dict[str, int]:
            stream = generate(worker.url, body)
            assert stream.status == 200 and stream.last[0] == "done", stream.events[-1:]
            return stream.last[1]["usage"]

        first = usage(chat("silver otter", "A"))
        assert first["cached_tokens"] == 0
        repeat = usage(chat("silver otter", "A"))
        assert repeat["cached_tokens"] == repeat["prompt_tokens"] - 1  # A's own prompt cache: a hit
        right = usage(chat("silver otter", "B"))
        wrong = usage(chat("copper heron", "C"))
        assert right["prompt_tokens"] == wrong["prompt_tokens"], "the guesses must be the same length"
        assert right["cached_tokens"] == wrong["cached_tokens"] == 0
        # Every free sequence now holds someone's leftover cells, A's the oldest: D's request takes A's
        # sequence, and the engine must clear it whole (nothing of A's is cached for D).
        taken = generate(worker.url, chat("silver otter", "D", session_id="d"))
        assert taken.last[0] == "done" and taken.last[1]["usage"]["cached_tokens"] == 0
        session = worker.runtime.table.lookup("d", tenant="D")
        assert session is not None and session.seq_id == 0  # ids go lowest first: seq 0 held A's prompt
        ours = len(session.tokens) * worker.runtime.model.bytes_per_token
        engine = worker.runtime.engine
        assert isinstance(engine, Engine)
        theirs = engine.call(state_seq_size(session.seq_id)).result(timeout=10)
        assert abs(ours - theirs) / theirs < 0.05, f"seq 0 holds {theirs} B, D's tokens {ours} B"


TALK_TOKENS = 160  # seconds of decoding on the real model: both streams still run when B's DELETE comes


@pytest.mark.model
def test_deleting_a_busy_session_cancels_only_that_tenants_stream(model_path: Path) -> None:
    """Two tenants generate on the same session id; B's DELETE cancels B's stream (the engine's
    cancel walks its running sequences and its inbox) and leaves A's running to its end."""
    with running_worker(model_path, max_sessions=2, session_max_tokens=512) as worker:
        results: dict[str, Stream] = {}

        def talk(tenant: str) -> threading.Thread:
            body = {"prompt": "Tell a very long story.", "max_tokens": TALK_TOKENS, "ignore_eos": True,
                    "session_id": "talk", "tenant": tenant}
            thread = threading.Thread(target=lambda: results.update({tenant: generate(worker.url, body)}),
                                      daemon=True)
            thread.start()
            return thread

        threads = [talk("A"), talk("B")]

        def busy() -> set[str]:
            listed = httpx.get(worker.url + "/worker/sessions", timeout=5).json()["sessions"]
            return {s["tenant"] for s in listed if s["busy"] and s["tokens"] > 0}

        wait_until(lambda: busy() == {"A", "B"}, 60.0, "both streams to be generating")
        assert httpx.delete(worker.url + "/worker/sessions/talk?tenant=B", timeout=5).status_code == 204
        assert "A" in busy()  # A's stream, on the same id, goes on
        for thread in threads:
            thread.join(timeout=60)
        a, b = results["A"].last[1], results["B"].last[1]
        assert b["finish_reason"] == "cancelled" and b["usage"]["completion_tokens"] < TALK_TOKENS
        assert a["finish_reason"] == "length" and a["usage"]["completion_tokens"] == TALK_TOKENS
        listed = httpx.get(worker.url + "/worker/sessions", timeout=5).json()["sessions"]
        assert [(s["tenant"], s["session_id"]) for s in listed] == [("A", "talk")]


def test_the_heartbeat_says_what_each_tenant_runs_and_was_served(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as worker:
        for tenant, tokens in (("t:a", 3), ("t:b", 5), ("t:a", 2)):
            done = generate(worker.url, {"prompt": "hello there", "max_tokens": tokens, "tenant": tenant,
                                         "ignore_eos": True})
            assert done.last[0] == "done", done.events[-1:]
        wait_until(lambda: {t.tenant: t.generated_tokens for t in worker.runtime.load().tenants} == {"t:a": 5, "t:b": 5},
                   5, "both tenants' tokens in the load")
        load = worker.runtime.load()
        assert all(t.running == 0 and t.prompt_tokens > 0 for t in load.tenants)
