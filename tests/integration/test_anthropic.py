"""Anthropic's Messages API end to end: the official `anthropic` client against the real coordinator and two
real workers running the real model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import pytest

from tests.integration.conftest import Cluster, alive_worker, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"  # general.name, lower-cased (README: model names)
USER = {"role": "user", "content": "Name three colors."}
# About 300 tokens of the model's tokenizer: most of a prompt that fits the cluster's 512-token sessions.
SYSTEM = ("You are a careful assistant for a small hardware shop. " * 30).strip()


@pytest.fixture
async def claude(cluster: Cluster) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60)
    yield client
    await client.close()


async def test_a_message_and_a_stream_give_the_same_greedy_text(claude: anthropic.AsyncAnthropic) -> None:
    whole = await claude.messages.create(model=MODEL, max_tokens=16, messages=[USER],  # type: ignore[list-item]
                                         extra_body={"temperature": 0})
    async with claude.messages.stream(model=MODEL, max_tokens=16, messages=[USER],  # type: ignore[list-item]
                                      extra_body={"temperature": 0}) as stream:
        streamed = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert whole.content[0].type == "text" and whole.content[0].text == streamed and streamed.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens") and final.stop_reason == whole.stop_reason
    assert whole.usage.output_tokens == final.usage.output_tokens <= 16
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 5
    counted = await claude.messages.count_tokens(model=MODEL, messages=[USER])  # type: ignore[list-item]
    # The same templated prompt a generation counts, as the worker's tokenizer makes it.
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def split_pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator and one worker whose KV is split per sequence, so a freed sequence keeps its cells for
    the next prompt (the prompt cache; the shared cluster's unified KV has none); the coordinator's URL."""
    logs = tmp_path_factory.mktemp("anthropic-pool")
    coordinator, url = start_coordinator(logs, "coordinator", "--heartbeat-interval", "1")
    worker, _ = start_worker(logs, "w1", url, model_path, "--threads", "1", "--heartbeat-interval", "0.5",
                             "--max-sessions", "2", "--session-max-tokens", "1024")
    try:
        wait_until(lambda: alive_worker(url, "w1") is not None, 60, "the worker to register", interval=0.2)
        yield url
    finally:
        stop_all([worker, coordinator])


async def test_a_repeated_long_system_prompt_is_read_from_the_workers_cache(split_pool: str) -> None:
    """With a `cache_control` breakpoint the first request's cells are kept: two other prompts in between
    take the worker's other sequences, though the kept one was freed longest ago (without the keep, the
    second would take it), and the repeat reads more than half its prompt from it."""
    claude = anthropic.AsyncAnthropic(base_url=split_pool, api_key="unused", max_retries=0, timeout=60)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = await claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=[USER])  # type: ignore[arg-type, list-item]
    for brief, ask in (("Numbers only, please, and nothing else at all.", "Count to three."),
                       ("Fruit names are all I want to hear from you today.", "Name a fruit.")):
        # Prompts that share too little with each other (and with the first) to reuse their cells.
        await claude.messages.create(model=MODEL, max_tokens=4, system=brief, messages=[{"role": "user", "content": ask}])
    second = await claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=[USER])  # type: ignore[arg-type, list-item]

    def prompt_of(usage: anthropic.types.Usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)

    prompt = prompt_of(second.usage)
    assert prompt == prompt_of(first.usage) > 250
    assert first.usage.input_tokens == second.usage.input_tokens == 0  # all of it read or written: kept
    assert (first.usage.cache_read_input_tokens or 0) < prompt / 2 < (first.usage.cache_creation_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= prompt / 2, second.usage
    assert second.usage.cache_creation_input_tokens == prompt - (second.usage.cache_read_input_tokens or 0)
    await claude.close()
