"""The prompt cache in host memory, on the real model: an interactive request's leftover cells, taken by
another tenant's requests, are saved to host memory and written back for its tenant's next prompt
that starts with them (worker/sessions/host_cache.py).

What must hold: the same greedy tokens as a worker that prefilled the whole prompt; the restored cells
counted as cached; the table's count of the sequence equal to llama.cpp's own; another tenant's prompt
never given them; a batch request's leftover never saved.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker
from worker.backends.llama_engine import state_seq_size

pytestmark = pytest.mark.model

QUESTION = ("Tell me, keeper, about the winter the harbour froze, the ships that waited outside the bar for "
            "nine days, and what the fishermen's wives brought to the lighthouse on the last night of it.")
OTHERS = ["List three rivers of Europe.", "Name a colour of the sea.", "Count from one to five.",
          "Say a word about the wind."]


def body(tenant: str, content: str, **more: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
            "tenant": tenant, **more}


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, max_sessions=2, session_max_tokens=256) as running:
        yield running


def _displace(worker: RunningWorker, tenant: str, priority: str = "interactive") -> None:
    """Two requests of `tenant` at once, twice: both sequences held them, so the leftover before them
    was taken."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for pair in (OTHERS[:2], OTHERS[2:]):
            ends = pool.map(lambda content: generate(worker.url, body(tenant, content, priority=priority,
                                                                      max_tokens=24)).last[0], pair)
            assert list(ends) == ["done", "done"]


def test_a_tenants_leftover_taken_by_another_comes_back_from_host_memory(worker: RunningWorker,
                                                                        model_path: Path) -> None:
    first = generate(worker.url, body("a", QUESTION))
    assert first.last[0] == "done"
    saves = worker.metric("worker_host_cache_saves_total")
    _displace(worker, "b")
    assert worker.metric("worker_host_cache_saves_total") > saves, "the leftover was not saved"
    restored = worker.metric("worker_host_cache_restored_tokens_total")
    # Another tenant's same prompt gets none of it (a new tenant: no cells of its own anywhere).
    other = generate(worker.url, body("c", QUESTION))
    assert other.last[1]["usage"]["cached_tokens"] == 0
    assert worker.metric("worker_host_cache_restored_tokens_total") == restored
    _displace(worker, "b")
    restored = worker.metric("worker_host_cache_restored_tokens_total")  # b's own cells came back too
    again = generate(worker.url, {**body("a", QUESTION), "session_id": "host-1"})
    usage = again.last[1]["usage"]
    gained = worker.metric("worker_host_cache_restored_tokens_total") - restored
    try:
        # All of the prompt but its last token (decoded for the first token's logits) came back.
        assert gained == usage["cached_tokens"] == usage["prompt_tokens"] - 1, usage
        session = worker.runtime.table.lookup("host-1", tenant="a")
        assert session is not None
        ours = len(session.tokens) * worker.runtime.model.bytes_per_token
        theirs = worker.runtime.engine.call(state_seq_size(session.seq_id)).result(timeout=10)
        assert abs(ours - theirs) / theirs < 0.05, f"ours {ours} B vs llama.cpp {theirs} B"
    finally:
        httpx.delete(worker.url + "/worker/sessions/host-1?tenant=a")
    with running_worker(model_path, max_sessions=2, session_max_tokens=256, prompt_cache=False) as plain:
        alone = generate(plain.url, body("a", QUESTION))
        assert alone.last[1]["usage"]["cached_tokens"] == 0
    assert again.text == alone.text == first.text and len(again.tokens) == len(alone.tokens) > 0


def test_a_batch_requests_leftover_is_not_saved(worker: RunningWorker) -> None:
    assert generate(worker.url, body("d", QUESTION, priority="batch")).last[0] == "done"
    saves = worker.metric("worker_host_cache_saves_total")
    _displace(worker, "e", priority="batch")
    assert worker.metric("worker_host_cache_saves_total") == saves
    # Nor is a batch tenant's later interactive prompt given cells from host memory it never had.
    restored = worker.metric("worker_host_cache_restored_tokens_total")
    generate(worker.url, body("d", QUESTION))
    assert worker.metric("worker_host_cache_restored_tokens_total") == restored


def test_off_at_zero(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=2, session_max_tokens=256, host_cache_mib=0) as off:
        generate(off.url, body("a", QUESTION))
        _displace(off, "b")
        again = generate(off.url, body("a", QUESTION))
        assert off.metric("worker_host_cache_saves_total") == 0
        assert again.last[1]["usage"]["cached_tokens"] == 0
