"""Stored Responses across coordinators, end to end: two real coordinators, two real workers of the real
model heartbeating to both, the official `openai` package as the client. A response made through one
coordinator is continued through the other with `previous_response_id` and only the new input, over
HTTP and over the WebSocket: the turn runs on the worker that ran the first, which reuses the first
conversation's KV from its prompt cache (`cached_tokens` at least half the prompt); it is read back and
deleted through either; a coordinator's restart loses nothing; a drained worker's records move to the
other worker and their chains go on there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import Proc, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = [pytest.mark.process, pytest.mark.anyio]
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
INSTRUCTIONS = ("You are a careful assistant for a small gardening shop. You answer in one short sentence, "
                "name plants by their common names, and never give prices. ") * 3


def _alive(url: str, count: int) -> bool:
    listing = httpx.get(url + "/coordinator/health/workers", timeout=2).json()["workers"]
    return sum(w["state"] == "alive" for w in listing) == count


@contextlib.contextmanager
def two_coordinators(log_dir: Path, model_path: Path) -> Iterator[tuple[str, str, list[Proc]]]:
    a, a_url = start_coordinator(log_dir, "coord-a")
    b, b_url = start_coordinator(log_dir, "coord-b")
    procs = [a, b]
    try:
        for name in ("w1", "w2"):
            worker, _ = start_worker(log_dir, name, f"{a_url},{b_url}", model_path, "--threads", "1",
                                     "--max-sessions", "4", "--heartbeat-interval", "0.5")
            procs.append(worker)
        for url in (a_url, b_url):
            wait_until(lambda url=url: _alive(url, 2), 90, "both workers alive", interval=0.2)  # type: ignore[misc]
        yield a_url, b_url, procs
    finally:
        stop_all(reversed(procs))


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def _final(connection: Any) -> Any:
    async for event in connection:
        assert event.type != "error", event
        if event.type in ("response.completed", "response.incomplete"):
            return event.response
    raise AssertionError("the socket closed before a final event")


def _reused_most(response: Any) -> None:
    cached = response.usage.input_tokens_details.cached_tokens
    assert cached >= response.usage.input_tokens / 2, (cached, response.usage.input_tokens)


async def test_a_chain_continues_through_the_other_coordinator_over_http_and_the_socket(
        model_path: Path, tmp_path: Path) -> None:
    with two_coordinators(tmp_path, model_path) as (a_url, b_url, procs):
        a, b = _client(a_url), _client(b_url)
        try:
            first = await a.responses.with_raw_response.create(
                model=MODEL, instructions=INSTRUCTIONS, input="Name a red flower.", max_output_tokens=12,
                temperature=0)
            made = first.parse()
            second = await b.responses.with_raw_response.create(
                model=MODEL, instructions=INSTRUCTIONS, input="And a blue one?", previous_response_id=made.id,
                max_output_tokens=4, temperature=0)
            assert second.headers["x-worker-id"] == first.headers["x-worker-id"]
            continued = second.parse()
            assert continued.previous_response_id == made.id
            assert continued.usage is not None and made.usage is not None
            assert continued.usage.input_tokens > made.usage.input_tokens  # the first conversation came first
            _reused_most(continued)
            async with b.responses.connect(max_retries=0) as connection:  # the socket, through B
                await connection.response.create(model=MODEL, instructions=INSTRUCTIONS, input="And a white one?",
                                                 previous_response_id=continued.id, max_output_tokens=4,
                                                 temperature=0)
                third = await _final(connection)
            _reused_most(third)
            assert (await a.responses.retrieve(third.id)).previous_response_id == continued.id
            listed = await a.responses.input_items.list(continued.id)
            assert len(listed.data) == 1
            await b.responses.delete(made.id)
            with pytest.raises(openai.NotFoundError):
                await a.responses.retrieve(made.id)
        finally:
            await a.close()
            await b.close()
        # A restarted coordinator remembers nothing, and needs nothing: the records are the workers'.
        procs[0].terminate()
        procs[0].reap()
        procs[0], _ = start_coordinator(tmp_path, "coord-a2", port=int(a_url.rsplit(":", 1)[1]))
        wait_until(lambda: _alive(a_url, 2), 60, "both workers alive again", interval=0.2)
        a, b = _client(a_url), _client(b_url)
        try:
            raw = await a.responses.with_raw_response.create(
                model=MODEL, instructions=INSTRUCTIONS, input="And a yellow one?", previous_response_id=third.id,
                max_output_tokens=4, temperature=0)
            fourth = raw.parse()
            assert fourth.previous_response_id == third.id
            _reused_most(fourth)
            # Its worker drains: a coordinator moves the records to the other worker, and the chain goes on there.
            holder = {"w1": procs[2], "w2": procs[3]}[raw.headers["x-worker-id"]]
            holder.terminate()
            holder.reap()
            fifth = await b.responses.with_raw_response.create(
                model=MODEL, instructions=INSTRUCTIONS, input="And a green one?", previous_response_id=fourth.id,
                max_output_tokens=4, temperature=0)
            assert fifth.headers["x-worker-id"] != raw.headers["x-worker-id"]
            assert fifth.parse().previous_response_id == fourth.id
            assert (await a.responses.retrieve(third.id)).id == third.id
        finally:
            await a.close()
            await b.close()
