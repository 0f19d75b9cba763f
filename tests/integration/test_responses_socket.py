"""The Responses WebSocket end to end: the official `openai` package's `client.responses.connect()`
against the real coordinator and two real workers running the real model. A second turn sends only its
new input with `previous_response_id`; the socket puts the first turn's conversation before it, and the
worker that ran the first turn reuses that prefix from its cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.agent_pool import agent_pool

pytestmark = [pytest.mark.process, pytest.mark.anyio]
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
INSTRUCTIONS = ("You are a careful assistant for a small gardening shop. You answer in one short sentence, "
                "name plants by their common names, and never give prices. ") * 3


async def _final(connection: Any) -> Any:
    """The response of the next final event (an error event fails the test, naming itself)."""
    async for event in connection:
        assert event.type != "error", event
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            assert event.type != "response.failed", event
            return event.response
    raise AssertionError("the socket closed before a final event")


async def test_a_second_turn_on_the_socket_reuses_the_first_turns_prefix(model_path: Path, tmp_path: Path) -> None:
    with agent_pool(tmp_path, model_path, "--max-sessions", "4") as url:
        await _two_turns(url)


async def _two_turns(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        async with client.responses.connect(max_retries=0) as connection:
            await connection.response.create(model=MODEL, instructions=INSTRUCTIONS, input="Name a red flower.",
                                             store=False, max_output_tokens=12, temperature=0,
                                             reasoning={"effort": "none"})
            first = await _final(connection)
            await connection.response.create(model=MODEL, instructions=INSTRUCTIONS, input="And a blue one?",
                                             previous_response_id=first.id, store=False, max_output_tokens=4,
                                             temperature=0)
            second = await _final(connection)
    finally:
        await client.close()
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn's conversation came first
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= second.usage.input_tokens / 2, (cached, second.usage.input_tokens)
