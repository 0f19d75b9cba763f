"""A kept session's KV moved between two real workers of the same model (worker/api/transfer.py):
the next turn on the new worker is what it would have been on the old one, with the history's
tokens reused; every blob that would not land is refused and leaves no trace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.sessions.transfer import Origin, pack, split

pytestmark = pytest.mark.model
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
# Ten sessions (issue 19's integrity check), one of them under a tenant.
CONVERSATIONS = [("Name a river in France.", "And one in Spain?"), ("Count to five.", "Now backwards."),
                 ("Write a word that rhymes with cat.", "Another one."), ("What is 7 times 8?", "And 9 times 9?"),
                 ("Name a planet.", "A bigger one?"), ("Give me a colour.", "Its opposite?"),
                 ("Say hello in French.", "In German?"), ("Name a fruit.", "A red one?"),
                 ("What do bees make?", "Where do they live?"), ("Name an ocean.", "The smallest one?")]


@pytest.fixture(scope="module")
def pair(model_path: Path) -> Iterator[tuple[RunningWorker, RunningWorker]]:
    with (running_worker(model_path, threads=1, max_sessions=16) as a,
          running_worker(model_path, threads=1, max_sessions=16) as b):
        yield a, b


def kv_url(worker: RunningWorker, session_id: str, tenant: str = "") -> str:
    return f"{worker.url}/worker/sessions/{session_id}/kv" + (f"?tenant={tenant}" if tenant else "")


def turn(worker: RunningWorker, session_id: str, prompt: str, tenant: str = "") -> tuple[str, dict[str, Any]]:
    stream = generate(worker.url, {"prompt": prompt, "session_id": session_id, "tenant": tenant, **GREEDY})
    kind, done = stream.last
    assert stream.status == 200 and kind == "done", stream
    return stream.text, done["usage"]


def test_a_moved_session_continues_as_it_would_have_where_it_was(pair: tuple[RunningWorker, RunningWorker]) -> None:
    a, b = pair
    for i, (first, second) in enumerate(CONVERSATIONS):
        sid, tenant = f"moved-{i}", "team" if i == 1 else ""
        turn(a, sid, first, tenant)
        exported = httpx.get(kv_url(a, sid, tenant), timeout=30)
        assert exported.status_code == 200, exported.text
        held = int(exported.headers["x-kv-tokens"])
        imported = httpx.put(kv_url(b, sid, tenant), content=exported.content, timeout=30)
        assert imported.status_code == 201, imported.text
        assert imported.json() == {"session_id": sid, "tokens": held, "bytes": len(exported.content)}
        there, there_usage = turn(b, sid, second, tenant)
        here, here_usage = turn(a, sid, second, tenant)
        assert there == here  # greedy: the same cells give the same continuation
        # The new worker prefilled only the new turn: the whole moved history was reused.
        assert there_usage["cached_tokens"] == here_usage["cached_tokens"] >= held - 1
        assert there_usage["prompt_tokens"] == here_usage["prompt_tokens"]
    # The exporting worker still holds its sessions; both count what they hold.
    assert a.load()["sessions"] == b.load()["sessions"] == len(CONVERSATIONS)
    assert b.metric('worker_kv_transfers_total{direction="import",outcome="ok"}') == len(CONVERSATIONS)


def test_every_blob_that_would_not_land_is_refused_and_leaves_nothing(pair: tuple[RunningWorker, RunningWorker]) -> None:
    a, b = pair
    turn(a, "source", "Tell me about the moon.")
    blob = httpx.get(kv_url(a, "source"), timeout=30).content
    header, cells = split(blob)
    origin = Origin(header.model_identity, header.kv_type, header.llama_cpp)

    def held(worker: RunningWorker) -> tuple[int, int]:
        load = worker.load()
        return load["sessions"], load["kv_reserved_bytes"]

    before = held(b)
    damaged = {
        "a flipped byte": blob[:-1] + bytes([blob[-1] ^ 0x40]),
        "cut short": blob[:-100],
        "another model": pack(Origin("gguf:another-model", origin.kv_type, origin.llama_cpp), header.tokens, [],
                              bytes(cells)),
        # Consistent with its own digest, but not cells llama.cpp can read: refused by llama.cpp itself.
        "cells llama.cpp refuses": pack(origin, header.tokens, [], bytes(cells)[:len(cells) // 2]),
        "not a blob": b"hello",
    }
    for what, body in damaged.items():
        refused = httpx.put(kv_url(b, "victim"), content=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["reason"] == "kv_refused", (what, refused.text)
        assert held(b) == before, what
        assert httpx.get(kv_url(b, "victim"), timeout=10).status_code == 404, what  # nothing kept, no tombstone
    # An id the importer already holds, and an id the exporter does not.
    assert httpx.put(kv_url(b, "moved-0"), content=blob, timeout=30).status_code == 409
    assert httpx.get(kv_url(a, "nobody"), timeout=10).status_code == 404
    assert httpx.get(kv_url(a, "source", "another-tenant"), timeout=10).status_code == 404



# 294 tokens (446 until 2026-11-29, for the same checks): past the worker's 128-token floor for asking a
# peer, and the 200 the test asks for; it is prefilled in full three times.
LONG = " ".join(f"Rule {i}: every {w} in the archive is filed by colour, then by date." for i, w in
                enumerate(["map", "letter", "ledger", "photo", "deed", "diary", "chart", "receipt"] * 2))


def test_a_prompts_prefix_comes_from_the_peer_that_holds_it(pair: tuple[RunningWorker, RunningWorker]) -> None:
    a, b = pair
    there = generate(a.url, {"prompt": LONG, **GREEDY})  # one-shot: its cells stay behind as a prompt cache
    assert there.status == 200
    before = count(b, "ok")
    here = generate(b.url, {"prompt": LONG, "prefix_peer": a.url, **GREEDY})
    usage = here.last[1]["usage"]
    assert usage["prompt_tokens"] > 200 and usage["cached_tokens"] == usage["prompt_tokens"] - 1  # all but one
    assert here.text == there.text  # the same cells, the same greedy answer
    assert count(b, "ok") == before + 1
    # A peer that holds none of the prompt: prefilled here, as without the hint.
    other = generate(b.url, {"prompt": LONG.replace("archive", "museum"), "prefix_peer": a.url, **GREEDY})
    assert other.status == 200 and other.last[1]["usage"]["cached_tokens"] < 50
    assert count(b, "none") >= 1
    # A peer that does not answer at all: the same.
    gone = generate(b.url, {"prompt": LONG + " Again.", "prefix_peer": "http://127.0.0.1:9", **GREEDY})
    assert gone.status == 200 and gone.last[0] == "done"


def count(worker: RunningWorker, outcome: str) -> float:
    """Prefixes this worker asked a peer for, by outcome (a series not yet written counts 0)."""
    try:
        return worker.metric(f'worker_kv_transfers_total{{direction="peer_prefix",outcome="{outcome}"}}')
    except KeyError:
        return 0.0


def test_while_draining_a_session_is_handed_to_the_first_coordinator_that_asks(
        pair: tuple[RunningWorker, RunningWorker]) -> None:
    """Every coordinator of a pool moves a draining worker's sessions: the second to ask for one hears
    409, so the session is not copied to two workers."""
    a, _ = pair
    sid = "drained-once"
    turn(a, sid, "Remember the number seven.")
    try:
        assert httpx.get(kv_url(a, sid), timeout=30).status_code == 200  # not draining: as often as asked
        a.runtime.gate.draining = True
        first, second = httpx.get(kv_url(a, sid), timeout=30), httpx.get(kv_url(a, sid), timeout=30)
        assert first.status_code == 200 and second.status_code == 409, second.text
        assert second.json()["reason"] == "session_busy"
    finally:
        a.runtime.gate.draining = False
        httpx.delete(f"{a.url}/worker/sessions/{sid}", timeout=10)


def test_while_draining_the_coordinator_that_took_a_session_may_export_it_again(
        pair: tuple[RunningWorker, RunningWorker]) -> None:
    """Issue 50: its put found no receiver (killed mid-move), so it asks again; another coordinator, or
    one that gives no `mover`, still hears 409."""
    a, _ = pair
    sid = "drained-twice"
    turn(a, sid, "Remember the number eight.")
    try:
        a.runtime.gate.draining = True
        taken = httpx.get(kv_url(a, sid) + "?mover=c1", timeout=30)
        again = httpx.get(kv_url(a, sid) + "?mover=c1", timeout=30)
        assert taken.status_code == 200 and again.status_code == 200, again.text
        assert again.content == taken.content
        for other in ("?mover=c2", ""):
            refused = httpx.get(kv_url(a, sid) + other, timeout=30)
            assert refused.status_code == 409 and refused.json()["reason"] == "session_busy", refused.text
    finally:
        a.runtime.gate.draining = False
        httpx.delete(f"{a.url}/worker/sessions/{sid}", timeout=10)


def test_an_upload_that_never_sends_its_blob_frees_its_slot_after_the_grace(model_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: two PUTs declaring 200 MiB and sending nothing held both transfer slots for the edge's
    30 s body deadline; every move and peer fetch got 503 `transfers_full` meanwhile."""
    import socket
    import time

    monkeypatch.setattr("worker.api.transfer.BODY_GRACE", 0.5)
    with running_worker(model_path, threads=1, max_sessions=4, kv_transfers=1) as worker:
        host, port = worker.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as stalled:
            stalled.sendall(b"PUT /worker/sessions/s1/kv HTTP/1.1\r\nHost: w\r\nContent-Type: application/octet-stream"
                            b"\r\nContent-Length: 209715200\r\n\r\n" + b"x" * 1000)
            started = time.monotonic()
            answer = stalled.recv(4096)
            waited = time.monotonic() - started
            while b"request_timeout" not in answer and (more := stalled.recv(4096)):
                answer += more  # the head and the body may come in two segments
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]
        assert waited < 5  # the grace, not the edge's 30 s
        # The slot is free again: a real blob is taken (refused for what it is, not for the slot).
        refused = httpx.put(worker.url + "/worker/sessions/s2/kv", content=b"not a blob", timeout=10)
        assert refused.status_code == 400 and refused.json()["reason"] == "kv_refused", refused.text
